"""The data audit: duplicates, likely wrong labels and outliers, found on every split.

A test figure is only as good as the images under it. The same photo twice (re-saved,
resized, cropped), once in train and once in test, makes a model look better than it is;
a photo filed under the wrong class, or a blank frame, makes it look worse. The audit looks
at every image once, before the split is assigned, so that the split can keep each group of
duplicates on one side (training/data/split.py), and writes what it found as a flat list
(`audit.json`, one object per image and finding) that pandas reads as it is.

- Duplicates: the same bytes (SHA-256), or the same picture after re-compression, resizing or
  a crop of a few percent: perceptual and difference hashes (imagehash's) of the whole image
  and of its 90% and 95% crops (centre and corners), both hashes within DUPLICATE_BITS of 64.
  A crop of the original is then compared with the copy's whole, which a single hash of each
  misses (a 5% crop moves a 64-bit perceptual hash by ~10 bits, unrelated photos' by ~32).
- Likely wrong labels: cleanlab's `find_label_issues` on out-of-sample class probabilities
  (5-fold linear discriminants), ranked by self-confidence. What they classify: each image's
  8x8 thumbnail, or (`audit.labels_from: backbone`) the backbone a fine-tune starts from
  (training/models/features.py).
  Thumbnails tell digits and simple shapes apart, not most photos: where the classifier is
  right less than LABEL_CHECK_ACCURACY of the time the check says so and names nothing.
- Outliers: near-constant frames and sizes or aspects far from the rest of the set.

Nothing is dropped or relabelled here: the split keeps groups together and, only with
`audit.leakage: quarantine`, leaves the train-side copies of a group that already spans the
split out of training, recorded.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from training.data.rows import is_row, open_any, row_bytes

DUPLICATE_BITS = 8
"""Both hashes of two views within this many of 64 bits: on flowers-128 every pair at or
under 8 is one photo (some re-coloured or grey), most pairs at 11-12 are two photos."""
VIEWS = (1.0, 0.95, 0.9)
"""The whole image and its crops to these shares of each side (centre and four corners)."""
THUMBNAIL = 8
"""Each image as 8x8x3 for the label check: what tells digits or shapes apart, cheaply."""
MIN_SIDE_FOR_NEAR = 32
"""Under this side an image holds too little for a perceptual hash to tell copies from
look-alikes (8x8 digits all hash alike): only its exact copies are found."""
BLANK_STD = 2.0
"""A frame whose grey levels vary less than this (of 255) shows nothing."""
EXTREME_ASPECT = 3.0
EXTREME_SIZE = 4.0
"""An image whose shorter side is this many times under or over the set's median."""
FOLDS = 5
"""Out-of-sample probabilities from 5 folds; a class with fewer images is not label-checked."""
LABEL_CHECK_ACCURACY = 0.8
"""The label check reports only when its out-of-sample classifier is right this often."""


@dataclass(frozen=True)
class Look:
    """One image as the audit sees it."""

    sha256: str
    hashes: np.ndarray
    """uint64 [views, 2]: perceptual and difference hash of each view, the whole one first;
    [0, 2] for an image too small to compare but by its bytes."""
    thumbnail: np.ndarray
    """float32 [THUMBNAIL * THUMBNAIL * 3], 0..1"""
    grey_std: float
    width: int
    height: int


class Finding(BaseModel):
    """One image and what was found about it: a row of audit.json's `findings`."""

    kind: str
    """duplicate | leak | label_issue | outlier"""
    path: str
    """relative to the dataset root"""
    label: str
    side: str = ""
    """train | val | test | quarantined"""
    group: int | None = None
    """the duplicate group's id: every copy of one picture shares it"""
    suggested: str | None = None
    """label issues: the label the out-of-sample classifier gives"""
    score: float = 0.0
    """duplicates: bits from the group's first image (0: the same bytes); label issues: the
    given label's out-of-sample probability (lower, likelier wrong); outliers: how far out"""
    reason: str = ""


class AuditReport(BaseModel):
    findings: list[Finding] = []
    images: int = 0
    moved: int = 0
    """new images placed on their duplicates' side rather than their own draw's"""
    quarantined: list[str] = []
    label_features: str = "8x8 thumbnails"
    """What the label check classified: thumbnails, or a fine-tune's starting backbone."""
    label_check_accuracy: float | None = None
    """How often the label check's out-of-sample classifier was right; under
    LABEL_CHECK_ACCURACY its doubts are not reported (None: not run)."""

    def count(self, kind: str) -> int:
        if kind == "duplicate":
            return len({f.group for f in self.findings if f.kind in ("duplicate", "leak")})
        return sum(f.kind == kind for f in self.findings)

    def counts(self) -> dict[str, int]:
        """Run metrics: duplicate groups, groups across splits, label issues, outliers."""
        return {"audit_duplicate_groups": self.count("duplicate"),
                "audit_leaks": len({f.group for f in self.findings if f.kind == "leak"}),
                "audit_label_issues": self.count("label_issue"),
                "audit_outliers": self.count("outlier"),
                "audit_quarantined": len(self.quarantined)}

    def summary(self) -> str:
        c = self.counts()
        accuracy = self.label_check_accuracy
        labels = (f"{c['audit_label_issues']} likely wrong labels" if accuracy is None
                  or accuracy >= LABEL_CHECK_ACCURACY else
                  f"labels not checked ({self.label_features} tell the classes apart "
                  f"{accuracy:.0%} of the time, under {LABEL_CHECK_ACCURACY:.0%})")
        return (f"audit of {self.images} images: {c['audit_duplicate_groups']} duplicate groups "
                f"({c['audit_leaks']} across splits, {len(self.quarantined)} copies "
                f"quarantined), {self.moved} new images kept beside their duplicates, {labels}, "
                f"{c['audit_outliers']} outliers")


def look_at(root: Path, relpaths: list[str],
            on_progress: Callable[[int, int], None] = lambda done, total: None
            ) -> dict[str, Look]:
    """Every image's hashes, thumbnail and size, decoded in threads (PIL releases the GIL)."""
    done = 0

    def one(rel: str) -> Look:
        nonlocal done
        look = _look(root / rel)
        done += 1
        if done % 256 == 0:
            on_progress(done, len(relpaths))
        return look

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        looks = dict(zip(relpaths, pool.map(one, relpaths), strict=True))
    on_progress(len(relpaths), len(relpaths))
    return looks


def _look(path: Path) -> Look:
    from PIL import Image

    if is_row(path):
        data = row_bytes(path)
        img = open_any(path, None)
        width, height = img.size
    else:
        data = path.read_bytes()
        with Image.open(path) as header:  # the size as stored, before the reduced decode
            width, height = header.size
        # A JPEG decodes at 1/2..1/8 scale, no smaller than this: the hashes need no more.
        img = open_any(path, None, draft=(128, 128))
    rgb = img.convert("RGB")
    grey = rgb.convert("L")
    thumb = np.asarray(rgb.resize((THUMBNAIL, THUMBNAIL), Image.Resampling.BILINEAR),
                       dtype=np.float32) / 255
    hashes = (view_hashes(list(_views(grey))) if min(width, height) >= MIN_SIDE_FOR_NEAR
              else np.zeros((0, 2), dtype=np.uint64))
    return Look(sha256=hashlib.sha256(data).hexdigest(), hashes=hashes,
                thumbnail=thumb.reshape(-1),
                grey_std=float(np.asarray(grey, dtype=np.float32).std()),
                width=width, height=height)


def view_hashes(views: list) -> np.ndarray:
    """uint64 [views, 2]: imagehash's `phash` and `dhash` of each grey view, as integers
    (the same bits; computed here for all views at once, which is 10x faster)."""
    from PIL import Image
    from scipy.fft import dct

    lanczos = Image.Resampling.LANCZOS
    small = np.stack([np.asarray(v.resize((32, 32), lanczos), dtype=np.float64) for v in views])
    low = dct(dct(small, axis=1), axis=2)[:, :8, :8].reshape(len(views), 64)
    perceptual = low > np.median(low, axis=1, keepdims=True)
    rows = np.stack([np.asarray(v.resize((9, 8), lanczos), dtype=np.int16) for v in views])
    difference = (rows[:, :, 1:] > rows[:, :, :-1]).reshape(len(views), 64)
    return np.stack([_as_integers(perceptual), _as_integers(difference)], axis=1)


def _views(img):
    """The whole image, then its centre and corner crops to each share of VIEWS."""
    w, h = img.size
    yield img
    for share in VIEWS[1:]:
        cw, ch = max(1, round(w * share)), max(1, round(h * share))
        x, y = (w - cw) // 2, (h - ch) // 2
        for left, top in ((x, y), (0, 0), (w - cw, 0), (0, h - ch), (w - cw, h - ch)):
            yield img.crop((left, top, left + cw, top + ch))


def _as_integers(bits: np.ndarray) -> np.ndarray:
    """[n, 64] booleans, first bit highest, as n uint64 (imagehash's hex string's value)."""
    return np.packbits(bits, axis=1).view(">u8").reshape(-1).astype(np.uint64)


def duplicate_groups(looks: dict[str, Look]) -> list[list[tuple[str, int]]]:
    """Groups of two or more images of one picture, each as (path, bits from its first)."""
    paths = sorted(looks)
    parent = list(range(len(paths)))
    distance_to: dict[int, int] = {}

    def root_of(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(i: int, j: int, bits: int) -> None:
        a, b = root_of(i), root_of(j)
        if a != b:
            parent[max(a, b)] = min(a, b)
        distance_to[max(i, j)] = min(distance_to.get(max(i, j), 64), bits)

    by_bytes: dict[str, int] = {}
    for i, path in enumerate(paths):
        if (first := by_bytes.setdefault(looks[path].sha256, i)) != i:
            join(first, i, 0)
    hashed = [i for i, p in enumerate(paths) if len(looks[p].hashes)]
    if hashed:
        hashes = np.stack([looks[paths[i]].hashes for i in hashed])  # [n, views, 2]
        whole = hashes[:, 0]
        for k in range(len(hashed) - 1):
            bits = _nearest_view(hashes[k], whole[k], hashes[k + 1:], whole[k + 1:])
            for j in np.flatnonzero(bits <= DUPLICATE_BITS):
                join(hashed[k], hashed[k + 1 + int(j)], int(bits[j]))
    members: dict[int, list[int]] = defaultdict(list)
    for i in range(len(paths)):
        members[root_of(i)].append(i)
    return [[(paths[i], distance_to.get(i, 0) if i != group[0] else 0) for i in group]
            for group in members.values() if len(group) > 1]


def _nearest_view(views: np.ndarray, whole: np.ndarray, others: np.ndarray,
                  others_whole: np.ndarray) -> np.ndarray:
    """Bits between one image and each other: the closest of (its whole, any of their views)
    and (any of its views, their whole), a pair counted by the larger of its two hashes.
    Perceptual hashes first: the difference hashes only of the few pairs they let through."""
    near = np.minimum(np.bitwise_count(whole[0] ^ others[:, :, 0]),
                      np.bitwise_count(views[None, :, 0] ^ others_whole[:, None, 0])
                      ) <= DUPLICATE_BITS  # [others, views]
    bits = np.full(len(others), 64, dtype=np.uint8)
    for j in np.flatnonzero(near.any(axis=1)):
        mine = np.bitwise_count(whole ^ others[j]).max(axis=1)
        theirs = np.bitwise_count(views ^ others_whole[j]).max(axis=1)
        bits[j] = min(mine.min(), theirs.min())
    return bits


def label_issues(looks: dict[str, Look], labels: dict[str, str],
                 features: np.ndarray | None = None, seed: int = 0
                 ) -> tuple[list[Finding], float | None]:
    """Images whose out-of-sample probabilities doubt their label, likeliest first, and how
    often those probabilities were right (None: too few images of some class to tell).
    `features`: one row per image in path order (a backbone's); else the thumbnails.

    No findings when that is under LABEL_CHECK_ACCURACY: a classifier that misreads many
    right labels would name them all (on flowers-128 thumbnails: 46%, 1,749 "issues")."""
    from cleanlab.filter import find_label_issues
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    paths = sorted(labels)
    classes = sorted(set(labels.values()))
    given = np.array([classes.index(labels[p]) for p in paths])
    if len(classes) < 2 or np.bincount(given).min() < FOLDS:
        return [], None
    if features is None:
        features = np.stack([looks[p].thumbnail for p in paths])
    # Shrunk linear discriminants: as good as logistic regression on thumbnails, 5-10x faster.
    model = LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto")
    folds = StratifiedKFold(n_splits=FOLDS, shuffle=True, random_state=seed)
    probabilities = cross_val_predict(model, features, given, cv=folds, method="predict_proba")
    accuracy = float((probabilities.argmax(axis=1) == given).mean())
    if accuracy < LABEL_CHECK_ACCURACY:
        return [], accuracy
    # One process: cleanlab's default forks a pool, and a fork of the flow's process (Prefect's
    # threads holding locks) deadlocked there.
    ranked = find_label_issues(given, probabilities, return_indices_ranked_by="self_confidence",
                               n_jobs=1)
    return [Finding(kind="label_issue", path=paths[i], label=labels[paths[i]],
                    suggested=classes[int(probabilities[i].argmax())],
                    score=round(float(probabilities[i, given[i]]), 4),
                    reason=f"rank {rank + 1} by self-confidence")
            for rank, i in enumerate(ranked)], accuracy


def outliers(looks: dict[str, Look], labels: dict[str, str]) -> list[Finding]:
    """Near-constant frames, and sizes or aspects far from the set's."""
    if not looks:
        return []
    median_side = float(np.median([min(look.width, look.height) for look in looks.values()]))
    found = []
    for path, look in sorted(looks.items()):
        side, aspect = min(look.width, look.height), max(look.width, look.height) / max(
            1, min(look.width, look.height))
        reason, score = "", 0.0
        if look.grey_std < BLANK_STD:
            reason, score = f"near-constant frame (grey levels vary by {look.grey_std:.1f})", 1.0
        elif aspect > EXTREME_ASPECT:
            reason, score = f"aspect {aspect:.1f}:1", aspect
        elif side * EXTREME_SIZE < median_side or side > median_side * EXTREME_SIZE:
            reason = f"{look.width}x{look.height} against a median side of {median_side:.0f}"
            score = max(side, median_side) / max(1.0, min(side, median_side))
        if reason:
            found.append(Finding(kind="outlier", path=path, label=labels[path],
                                 score=round(score, 3), reason=reason))
    return found


HELD_OUT = {"train": 0, "val": 1, "test": 2}
"""How far from training a side is: a group that spans sides is placed on its furthest."""


def place_duplicates(groups: list[list[tuple[str, int]]], assignment: dict[str, str],
                     placed: set[str], order: Callable[[str], str]
                     ) -> tuple[dict[str, str], int, list[int]]:
    """Each duplicate group on one side: (the assignment, images moved, groups that span sides).

    An image already `placed` (in the ledger, or in a given split's folder) never moves. New
    copies join their placed copies' side; a group with none placed goes where its first
    image in the split's hash order was drawn. A group whose placed images already span sides
    stays as it is and is returned, to be reported or quarantined; its new images go to its
    furthest side from training, so that a new copy of a test image is tested, never trained on.
    """
    assignment = dict(assignment)
    moved, spanning = 0, []
    for index, group in enumerate(groups):
        paths = [path for path, _ in group]
        fixed = {assignment[p] for p in paths if p in placed}
        if len(fixed) > 1:
            spanning.append(index)
        side = (max(fixed, key=HELD_OUT.__getitem__) if fixed
                else assignment[min(paths, key=order)])
        for path in paths:
            if path not in placed and assignment[path] != side:
                assignment[path] = side
                moved += 1
    return assignment, moved, spanning


Features = tuple[str, Callable[[Path, list[str]], np.ndarray]]
"""(what they are, (root, paths) -> one row per path): what the label check reads instead of
thumbnails."""


def audit_split(root: Path, good: list[tuple[str, str]], assignment: dict[str, str],  # noqa: PLR0913
                placed: set[str], order: Callable[[str], str], quarantine: bool,
                on_progress: Callable[[int, int], None] = lambda done, total: None,
                features: Features | None = None) -> tuple[dict[str, str], AuditReport]:
    """Look at every image, keep duplicates on one side, and find label issues and outliers.

    Returns every image's side (the ledger's, quarantined ones included: they keep theirs) and
    the report, whose `quarantined` the manifest leaves out."""
    labels = dict(good)
    looks = look_at(root, sorted(labels), on_progress)
    groups = duplicate_groups(looks)
    assignment, moved, spanning = place_duplicates(groups, assignment, placed, order)
    report = AuditReport(images=len(labels), moved=moved)
    for index, group in enumerate(groups):
        sides = {assignment[path] for path, _ in group}
        furthest = max(sides, key=HELD_OUT.__getitem__)
        kind = "leak" if index in spanning else "duplicate"
        first = group[0][0]
        for path, bits in group:
            reason = ("the group's first" if path == first
                      else "the same bytes as the group's first"
                      if looks[path].sha256 == looks[first].sha256
                      else f"the same picture, {bits} of 64 bits from the group's first")
            if kind == "leak" and quarantine and assignment[path] != furthest:
                report.quarantined.append(path)
                reason += f"; quarantined: a copy is in {furthest}"
            report.findings.append(Finding(
                kind=kind, path=path, label=labels[path], side=assignment[path], group=index,
                score=bits, reason=reason))
    if features is not None:
        report.label_features = features[0]
    doubted, report.label_check_accuracy = label_issues(
        looks, labels, features[1](root, sorted(labels)) if features else None)
    for finding in [*doubted, *outliers(looks, labels)]:
        report.findings.append(finding.model_copy(update={"side": assignment[finding.path]}))
    return assignment, report
