"""The data audit: copies across splits found and kept on one side, planted label flips found,
a clean set left alone, and `trainflow audit` for a dataset on its own."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from training.config import AuditSpec, DatasetSpec, SplitSpec, TrainingSpec
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset
from training.evaluation.review import GALLERY, audit_section

CLASSES = {"red": (200, 60, 50), "green": (50, 170, 70), "blue": (50, 80, 200)}


def scene(label: str, index: int, size: int = 64) -> Image.Image:
    """A photo-like image: a class colour under a dozen random shapes, different every time."""
    rng = random.Random(f"{label}/{index}")
    tint = CLASSES[label]
    img = Image.new("RGB", (size, size), tuple(c // 2 for c in tint))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.randrange(size), rng.randrange(size)
        r = rng.randrange(4, size // 3)
        shade = tuple(min(255, max(0, c + rng.randrange(-90, 90))) for c in tint)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x - r, y - r, x + r, y + r],
                                                                 fill=shade)
    return img


def write_scenes(folder: Path, per_class: int, start: int = 0) -> None:
    for label in CLASSES:
        (folder / label).mkdir(parents=True, exist_ok=True)
        for i in range(start, start + per_class):
            scene(label, i).save(folder / label / f"{i:03d}.png")


def copies_of(img: Image.Image) -> dict[str, Image.Image]:
    """What a photo becomes on its way round: re-saved, resized, cropped."""
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=60)
    w, h = img.size
    return {"jpeg60": Image.open(io.BytesIO(buffer.getvalue())),
            "resized": img.resize((w * 3 // 4, h * 3 // 4)),
            "cropped": img.crop((w // 20, h // 20, w - w // 20, h - h // 20))}


AUDIT = AuditSpec()


def split(folder: Path, home: Path, audit: AuditSpec | None = AUDIT):
    ref = prepare(DatasetSpec(source=str(folder)), home)
    return split_dataset(ref, SplitSpec(), home, audit=audit)


def findings(result) -> list[dict]:
    return json.loads(result.audit.file.read_text())["findings"]


def sides(result) -> dict[str, str]:
    return {path: side for path, _, side in read_manifest(result.manifest)}


def test_copies_are_grouped_and_kept_on_one_side(tmp_path):
    folder = tmp_path / "data"
    write_scenes(folder, 40)
    originals = [f"{label}/{i:03d}.png" for label in CLASSES for i in (1, 2, 3)]
    planted = {}
    for rel in originals:
        label, name = rel.split("/")
        with Image.open(folder / rel) as img:
            for kind, copy in copies_of(img.convert("RGB")).items():
                path = f"{label}/{name[:-4]}-{kind}.{'jpg' if kind == 'jpeg60' else 'png'}"
                copy.save(folder / path)
                planted[path] = rel
        (folder / label / f"{name[:-4]}-exact.png").write_bytes((folder / rel).read_bytes())
        planted[f"{label}/{name[:-4]}-exact.png"] = rel

    result = split(folder, tmp_path / "home")

    groups = {}
    for f in findings(result):
        if f["kind"] == "duplicate":
            groups.setdefault(f["group"], set()).add(f["path"])
    by_original = {rel: {rel, *(p for p, o in planted.items() if o == rel)} for rel in originals}
    assert sorted(map(sorted, groups.values())) == sorted(map(sorted, by_original.values()))
    placed = sides(result)
    for members in by_original.values():
        assert len({placed[p] for p in members}) == 1, {p: placed[p] for p in members}
    assert result.audit.counts["audit_duplicate_groups"] == len(originals)
    assert result.audit.counts["audit_leaks"] == 0


def test_a_new_copy_of_a_test_image_goes_to_test_and_nothing_placed_moves(tmp_path):
    folder, home = tmp_path / "data", tmp_path / "home"
    write_scenes(folder, 30)
    before = sides(split(folder, home))
    tested = sorted(p for p, s in before.items() if s == "test")[:3]
    for rel in tested:  # a retrain's new images include re-saved copies of test images
        with Image.open(folder / rel) as img:
            copies_of(img.convert("RGB"))["jpeg60"].save(folder / f"{rel[:-4]}-again.jpg")
    write_scenes(folder, 10, start=30)

    after = split(folder, home)

    placed = sides(after)
    assert all(placed[p] == s for p, s in before.items())
    assert all(placed[f"{rel[:-4]}-again.jpg"] == "test" for rel in tested)
    assert after.audit.counts["audit_leaks"] == 0


def test_copies_split_before_the_audit_are_reported_or_quarantined(tmp_path):
    folder, home = tmp_path / "data", tmp_path / "home"
    write_scenes(folder, 30)
    for label in CLASSES:
        for i in range(30):
            src = folder / label / f"{i:03d}.png"
            (folder / label / f"{i:03d}-copy.png").write_bytes(src.read_bytes())
    old = sides(split(folder, home, audit=None))  # the ledger from before audits existed
    spanning = [f"{label}/{i:03d}-copy.png" for label in CLASSES for i in range(30)
                if old[f"{label}/{i:03d}-copy.png"] != old[f"{label}/{i:03d}.png"]]
    assert spanning  # some copies were split from their originals

    reported = split(folder, home)
    assert sides(reported) == old  # reporting changes nothing
    assert reported.audit.counts["audit_leaks"] == len(spanning)
    leaks = [f for f in findings(reported) if f["kind"] == "leak"]
    assert {f["path"] for f in leaks} >= set(spanning)
    # The review page's section: each group across the split with its thumbnails.
    page = audit_section(reported.audit.file, folder)
    assert page.count("<h3>Across splits") == min(GALLERY, len(spanning))
    assert page.count('src="data:image/png;base64,') >= 2 * min(GALLERY, len(spanning))

    quarantined = split(folder, home, audit=AuditSpec(leakage="quarantine"))
    kept = sides(quarantined)
    audit = json.loads(quarantined.audit.file.read_text())
    assert audit["quarantined"] and not set(audit["quarantined"]) & set(kept)
    for path in audit["quarantined"]:  # the copy nearer training is the one left out
        original = path.replace("-copy", "")
        other = original if path != original else path.replace(".png", "-copy.png")
        assert kept[other] in ("val", "test") and old[path] != "test"
    assert all(kept[p] == s for p, s in old.items() if p in kept)
    test_images = {p for p, s in kept.items() if s == "test"}
    train_images = {p for p, s in kept.items() if s == "train"}
    assert not {p.replace("-copy", "") for p in test_images} & {
        p.replace("-copy", "") for p in train_images}


def digits_folder(folder: Path, flips: int, seed: int = 0) -> set[str]:
    """sklearn's digits as 32 px PNG files, `flips` of them filed under another digit."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    flipped = set(rng.choice(len(digits.target), flips, replace=False).tolist())
    paths = set()
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        if i in flipped:
            label = (label + rng.integers(1, 10)) % 10
            paths.add(f"{label}/{i:04d}.png")
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray((pixels * 15).astype(np.uint8)).resize((32, 32)).save(
            folder / str(label) / f"{i:04d}.png")
    return paths


def test_planted_label_flips_rank_among_the_first_issues(tmp_path):
    planted = digits_folder(tmp_path / "digits", flips=30)
    result = split(tmp_path / "digits", tmp_path / "home")
    issues = [f for f in findings(result) if f["kind"] == "label_issue"]
    top = {f["path"] for f in issues[:2 * len(planted)]}
    assert len(top & planted) >= 0.7 * len(planted), (len(top & planted), len(issues))
    flipped = next(f for f in issues if f["path"] in planted)
    assert flipped["suggested"] != flipped["label"] and 0 <= flipped["score"] < 0.5


def test_a_clean_set_has_nothing_to_report(tmp_path):
    write_scenes(tmp_path / "data", 40)
    result = split(tmp_path / "data", tmp_path / "home")
    assert findings(result) == []
    assert set(result.audit.counts.values()) == {0}
    assert "0 duplicate groups" in result.audit.summary


def test_blank_frames_and_extreme_shapes_are_outliers(tmp_path):
    folder = tmp_path / "data"
    write_scenes(folder, 30)
    Image.new("RGB", (64, 64), (128, 128, 128)).save(folder / "red" / "blank.png")
    scene("green", 99, size=64).resize((256, 48)).save(folder / "green" / "banner.png")
    found = {f["path"]: f for f in findings(split(folder, tmp_path / "home"))
             if f["kind"] == "outlier"}
    assert set(found) == {"red/blank.png", "green/banner.png"}
    assert "near-constant" in found["red/blank.png"]["reason"]
    assert "aspect" in found["green/banner.png"]["reason"]


@pytest.mark.slow
def test_trainflow_audit_reports_a_folder_before_any_training(tmp_path):
    folder = tmp_path / "data"
    write_scenes(folder, 30)
    (folder / "red" / "000-copy.png").write_bytes((folder / "red" / "000.png").read_bytes())
    done = subprocess.run(
        [sys.executable, "-m", "commands.main", "audit", str(folder), "--output",
         str(tmp_path / "audit.json")], capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "TRAINFLOW_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 duplicate groups" in done.stdout
    assert "red/000-copy.png" in done.stdout
    written = json.loads((tmp_path / "audit.json").read_text())
    assert {f["path"] for f in written["findings"]} == {"red/000.png", "red/000-copy.png"}


BACKBONE = textwrap.dedent("""
    from pathlib import Path

    import torch
    from torch import nn

    WEIGHTS = Path(__file__).with_name("weights.pt")

    def network():
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                             nn.Flatten(), nn.Linear(256, 10))

    def pretrained(num_classes):
        loaded = network()
        loaded.load_state_dict(torch.load(WEIGHTS, weights_only=True))
        loaded[-1] = nn.Linear(256, num_classes)
        return loaded
""")


def test_a_fine_tune_checks_labels_on_its_starting_backbone(tmp_path, monkeypatch):
    import torch

    from tasks.data import starting_features
    from tests.user_code import install_package

    install_package(tmp_path / "code", monkeypatch, "auditnets", {"nets": BACKBONE})
    from auditnets.nets import WEIGHTS, network

    torch.manual_seed(3)
    torch.save(network().state_dict(), WEIGHTS)
    folder = tmp_path / "data"
    write_scenes(folder, 40)
    flipped = set()
    for label, other in (("red", "green"), ("green", "blue"), ("blue", "red")):
        for i in (5, 6):
            (folder / other / f"{label}-{i:03d}.png").write_bytes(
                (folder / label / f"{i:03d}.png").read_bytes())
            (folder / label / f"{i:03d}.png").unlink()
            flipped.add(f"{other}/{label}-{i:03d}.png")
    spec = TrainingSpec(model="auditnets.nets:pretrained", pretrained=True, image_size=32)
    ref = prepare(DatasetSpec(source=str(folder)), tmp_path / "home")
    backbone = AuditSpec(labels_from="backbone")
    result = split_dataset(ref, SplitSpec(), tmp_path / "home", audit=backbone,
                           features=starting_features(spec, backbone))
    audit = json.loads(result.audit.file.read_text())
    assert audit["label_features"] == "auditnets.nets:pretrained's starting backbone"
    assert audit["label_check_accuracy"] >= 0.8
    issues = [f["path"] for f in audit["findings"] if f["kind"] == "label_issue"]
    assert set(issues[:2 * len(flipped)]) >= flipped


def test_the_hashes_are_imagehashs_bits():
    """The audit computes every view's hashes at once; they must be imagehash's own."""
    import imagehash

    from training.data.audit import _views, view_hashes

    views = list(_views(scene("blue", 7, size=96).convert("L")))
    expected = [[int(str(imagehash.phash(v)), 16), int(str(imagehash.dhash(v)), 16)]
                for v in views]
    assert view_hashes(views).tolist() == expected
