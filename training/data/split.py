"""The split stage: check every image, then a stratified, seeded, stable train/val/test split.

Stability: a file's split, once given, never changes. Each split folder keeps a ledger of
the assignments it made; files already in it keep their split, and new files fill each
class's quotas in the order of a seeded hash of their relative path. Re-splitting the same
files gives the same bytes, and retraining on grown data never moves an old test image
into training. From an empty ledger the per-class counts are exactly round(n * fraction).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainflow_serving.images import Geometry, as_geometry
from training.config import AuditSpec, SplitSpec
from training.data.audit import AuditReport, Features, audit_split
from training.data.images import ImageCheck, check_image
from training.data.labels import DatasetError, given_splits
from training.data.sources import TABLE_LABELS, DatasetRef, labelled_files
from training.data.store import DecodeStore, compact, decode_into_stores, prune_stores
from training.handoff import AuditResult, SplitResult
from training.storage import file_lock, write_json_atomic, write_text_atomic

SPLITS = ("train", "val", "test")
MAX_UNREADABLE = 0.05


def split_key(ref: DatasetRef, spec: SplitSpec) -> str:
    ident = json.dumps([ref.source, str(ref.root), ref.labels, spec.model_dump()], sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def hash_order(seed: int, relpath: str) -> str:
    return hashlib.sha256(f"{seed}\0{relpath}".encode()).hexdigest()


def check_images(root: Path, relpaths: list[str]) -> list[ImageCheck]:
    # PIL releases the GIL while decoding, so threads use every core without pickling.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda rel: check_image(root, rel), relpaths))


def split_dataset(ref: DatasetRef, spec: SplitSpec, home: Path,
                  sides: dict[str, Geometry | int] | None = None,
                  on_progress: Callable[[int, int], None] = lambda done, total: None,
                  audit: AuditSpec | None = None, features: Features | None = None
                  ) -> SplitResult:
    """Check every image, audit them (`audit`, training/data/audit.py), write the manifest.

    With `sides` (split -> the geometry a training decodes it at), the check is the
    training's decode: each image is decoded once, at its split's side, into the decode store
    (training/data/store.py), and the training finds it there. Without, each image is decoded
    at the smallest scale that still reads every byte.
    """
    folder = home / "splits" / split_key(ref, spec)
    # One writer per split folder: its ledger is read, extended and written again, so two
    # first runs (or two data versions) at once would each drop the other's assignments.
    with file_lock(folder.parent / f".{folder.name}.lock"):
        return _split_under_lock(ref, spec, folder, sides, on_progress, audit, features)


def version_folder(ref: DatasetRef, audit: AuditSpec | None, features: Features | None = None
                   ) -> str:
    """One folder per data version and audit (policy and label features): quarantine changes
    the manifest, another backbone the label check."""
    if audit is None or not audit.enabled:
        return ref.fingerprint[:16]
    what = audit.model_dump_json() + (features[0] if features else "")
    policy = hashlib.sha256(what.encode()).hexdigest()[:6]
    return f"{ref.fingerprint[:16]}-audit-{policy}"


def _split_under_lock(ref: DatasetRef, spec: SplitSpec, folder: Path,
                      sides: dict[str, Geometry | int] | None,
                      on_progress: Callable[[int, int], None],
                      audit: AuditSpec | None, features: Features | None) -> SplitResult:
    out = folder / version_folder(ref, audit, features)
    if (reused := _reuse(out, ref, sides, folder, on_progress)) is not None:
        return reused
    pairs = labelled_files(ref)
    given = (given_splits(ref.root) if spec.respect_given and ref.labels in ("folders", TABLE_LABELS)
             else None)
    ledger_path = folder / "ledger.json"
    ledger: dict[str, str] = json.loads(ledger_path.read_text()) if ledger_path.exists() else {}
    hoped = _assign(pairs, ledger, spec, given) if sides else None
    checks = _check_all(ref.root, pairs, hoped, sides, folder, on_progress)
    bad = [c for c in checks if not c.ok]
    good_paths = {c.path for c in checks if c.ok}
    good = [(rel, label) for rel, label in pairs if rel in good_paths]
    by_class: dict[str, list[str]] = defaultdict(list)
    for rel, label in good:
        by_class[label].append(rel)
    if given is None:
        _check_class_sizes(ref, by_class, spec)
    # With every image readable, the assignment is the hoped one (the same inputs).
    assignment = hoped if hoped is not None and not bad else _assign(good, ledger, spec, given)
    report = None
    if audit is not None and audit.enabled:
        # A split that came given is never changed: its leaks are reported or quarantined.
        placed = set(ledger) | ({rel for rel, _ in good} if given is not None else set())
        assignment, report = audit_split(
            ref.root, good, assignment, placed, lambda rel: hash_order(spec.seed, rel),
            audit.leakage == "quarantine", on_progress, features)
    if given is not None:
        _check_given_splits(ref, good, assignment)
    if sides and assignment != hoped:
        decode_into_stores(ref.root, _by_side(assignment, sides), folder, on_progress)

    left_out = set(report.quarantined) if report else set()
    rows = sorted((rel, label, assignment[rel]) for rel, label in good if rel not in left_out)
    manifest_text = _manifest_csv(rows)
    counts = {s: dict(sorted(Counter(lbl for _, lbl, sp in rows if sp == s).items())) for s in SPLITS}
    # Ledger first: if we die after it, a re-run reproduces the same manifest from it.
    write_json_atomic(ledger_path, {**ledger, **assignment}, compact=True)
    write_json_atomic(out / "quarantine.json", [c.__dict__ for c in bad])
    write_json_atomic(out / "counts.json", counts)
    write_text_atomic(out / "manifest.csv", manifest_text)
    result = SplitResult(
        manifest=out / "manifest.csv",
        manifest_sha256=hashlib.sha256(manifest_text.encode()).hexdigest(),
        counts=counts, quarantined=len(bad), class_names=sorted(by_class),
        channels=1 if all(c.grayscale for c in checks if c.ok) else 3,
        root=ref.root, given_splits=given,
        audit=_write_audit(out, report, audit) if report is not None and audit else None)
    write_json_atomic(out / "summary.json", result.model_dump(mode="json"))
    clean_up(folder, keep=good_paths)
    return result


def _reuse(out: Path, ref: DatasetRef, sides: dict[str, Geometry | int] | None, folder: Path,
           on_progress: Callable[[int, int], None]) -> SplitResult | None:
    """The split this version already has, its images decoded at `sides`; None if none."""
    if not ((out / "summary.json").is_file() and (out / "manifest.csv").is_file()):
        return None
    # The fingerprint covers every file's content, so the checks and the assignment would
    # come out the same: a scheduled retrain on unchanged data decodes nothing here.
    result = SplitResult.model_validate_json((out / "summary.json").read_text())
    if sides:
        decode_into_stores(ref.root, _by_side(_assignment(result), sides), folder, on_progress)
        prune_stores(folder)
    return result


def _check_all(root: Path, pairs: list[tuple[str, str]], hoped: dict[str, str] | None,
               sides: dict[str, Geometry | int] | None, folder: Path,
               on_progress: Callable[[int, int], None]) -> list[ImageCheck]:
    """Every image checked, and with `sides` decoded at its hoped split's side (assigned as if
    every image were readable; the few a bad file moves are decoded again later). Too many
    unreadable images stop the split."""
    if sides and hoped is not None:
        checks = _decode_checked(root, pairs, _by_side(hoped, sides), folder, on_progress)
    else:
        checks = check_images(root, [rel for rel, _ in pairs])
    bad = [c for c in checks if not c.ok]
    if len(bad) > MAX_UNREADABLE * len(pairs):
        examples = "; ".join(f"{c.path}: {c.reason}" for c in bad[:5])
        raise DatasetError(
            f"{len(bad)} of {len(pairs)} images are unreadable (over {MAX_UNREADABLE:.0%}); "
            f"fix or remove them. First: {examples}"
        )
    return checks


def _write_audit(out: Path, report: AuditReport, audit: AuditSpec) -> AuditResult:
    path = out / "audit.json"
    write_json_atomic(path, {"policy": audit.model_dump(), **report.model_dump(mode="json")})
    return AuditResult(file=path, counts=report.counts(), summary=report.summary(),
                       label_issue_share=report.count("label_issue") / max(1, report.images),
                       policy=audit.model_dump())


def _decode_checked(root: Path, pairs: list[tuple[str, str]], wanted: dict[int, list[str]],
                    folder: Path, on_progress: Callable[[int, int], None]) -> list[ImageCheck]:
    """Every file's check: from this decode pass, or from the store that decoded it before."""
    outcomes = decode_into_stores(root, wanted, folder, on_progress)
    stored: dict[str, bool] = {}
    for side, relpaths in wanted.items():
        store = DecodeStore(folder, side)
        with store.locked(exclusive=False) as index:
            known = [rel for rel in relpaths if rel not in outcomes]
            stored.update(zip(known, store.lookup(index, known).grayscale, strict=True))
    checks = []
    for rel, _ in pairs:
        if rel in outcomes:
            o = outcomes[rel]
            checks.append(ImageCheck(rel, ok=o.ok, grayscale=o.grayscale, reason=o.reason))
        else:
            checks.append(ImageCheck(rel, ok=True, grayscale=stored[rel]))
    return checks


def _assignment(result: SplitResult) -> dict[str, str]:
    return {rel: split for rel, _, split in read_manifest(result.manifest)}


def _by_side(assignment: dict[str, str], sides: dict[str, Geometry | int]
             ) -> dict[Geometry, list[str]]:
    wanted: dict[Geometry, list[str]] = defaultdict(list)
    for rel, split in sorted(assignment.items()):
        wanted[as_geometry(sides[split])].append(rel)
    return dict(wanted)


def _assign(pairs: list[tuple[str, str]], ledger: dict[str, str], spec: SplitSpec,
            given: dict[str, str] | None = None) -> dict[str, str]:
    """Each file's split. With `given` (folder -> split), files keep their folder's split, and
    when no val folder is given, val is carved from the given train as a split would."""
    if given is None:
        return _assign_by_class(pairs, ledger, spec)
    assignment = {rel: given[rel.split("/", 1)[0]] for rel, _ in pairs}
    if "val" not in given.values():
        train = [(rel, label) for rel, label in pairs if assignment[rel] == "train"]
        carve = spec.model_copy(update={"test_fraction": 0.0})
        assignment.update(_assign_by_class(train, ledger, carve))
    return assignment


def _assign_by_class(pairs: list[tuple[str, str]], ledger: dict[str, str], spec: SplitSpec
                     ) -> dict[str, str]:
    by_class: dict[str, list[str]] = defaultdict(list)
    for rel, label in pairs:
        by_class[label].append(rel)
    assignment: dict[str, str] = {}
    for files in by_class.values():
        assignment.update(_assign_class(files, ledger, spec))
    return assignment


def _check_given_splits(ref: DatasetRef, good: list[tuple[str, str]],
                        assignment: dict[str, str]) -> None:
    """Every class in every given split: a test set without a class cannot test it."""
    seen = {(label, assignment[rel]) for rel, label in good}
    classes = sorted({label for _, label in good})
    if len(classes) < 2:
        raise DatasetError(f"the dataset has one class ({classes[0]!r}); a classifier needs at "
                           "least two")
    for split in SPLITS:
        missing = [c for c in classes if (c, split) not in seen]
        if missing:
            raise DatasetError(
                f"the {split} split of {ref.root} has no readable images of class "
                f"{missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                "add some, or set split.respect_given=false to split all images anew")


def clean_up(folder: Path, keep: set[str]) -> None:
    """Keep a split folder's decoded images to the files it still lists and the sides in use.

    Each store is the dataset again at one size (25,000 photos at 224 px: about 3.8 GB).
    Per-version caches of the earlier layout (`<version>/cache`) are removed: nothing reads them.
    """
    for legacy in folder.glob("*/cache"):
        shutil.rmtree(legacy, ignore_errors=True)
    for index in folder.glob("decoded/*/index.json"):
        compact(DecodeStore(folder, Geometry.parse(index.parent.name)), keep)
    prune_stores(folder)


def _check_class_sizes(ref: DatasetRef, by_class: dict[str, list[str]], spec: SplitSpec) -> None:
    empty = [name for name in ref.class_names if not by_class.get(name)]
    if empty:
        raise DatasetError(f"class {empty[0]!r} has no readable images; add images or remove it")
    if len(by_class) < 2:
        raise DatasetError(
            f"the dataset has one class ({next(iter(by_class))!r}); a classifier needs at least two"
        )
    for name, files in sorted(by_class.items()):
        quotas = _quotas(len(files), spec)
        if min(quotas.values()) < 1:
            need = max(
                _smallest_class(spec.val_fraction), _smallest_class(spec.test_fraction), 3
            )
            raise DatasetError(
                f"class {name!r} has {len(files)} readable images, too few to appear in train, "
                f"val and test with val_fraction={spec.val_fraction}, "
                f"test_fraction={spec.test_fraction}; it needs at least {need}"
            )


def _smallest_class(fraction: float) -> int:
    n = 1
    while round(n * fraction) < 1:
        n += 1
    return n


def _quotas(n: int, spec: SplitSpec) -> dict[str, int]:
    test = round(n * spec.test_fraction)
    val = round(n * spec.val_fraction)
    return {"test": test, "val": val, "train": n - test - val}


def _assign_class(files: list[str], ledger: dict[str, str], spec: SplitSpec) -> dict[str, str]:
    kept = {f: ledger[f] for f in files if f in ledger}
    have = Counter(kept.values())
    quotas = _quotas(len(files), spec)
    new = sorted((f for f in files if f not in ledger), key=lambda f: hash_order(spec.seed, f))
    assignment = dict(kept)
    for split in ("test", "val"):
        take = max(0, quotas[split] - have[split])
        for f in new[:take]:
            assignment[f] = split
        new = new[take:]
    assignment.update((f, "train") for f in new)
    return assignment


def _manifest_csv(rows: list[tuple[str, str, str]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "label", "split"])
    writer.writerows(rows)
    return buffer.getvalue()


def read_manifest(manifest: Path) -> list[tuple[str, str, str]]:
    with open(manifest, newline="", encoding="utf-8") as f:
        return [(r["path"], r["label"], r["split"]) for r in csv.DictReader(f)]
