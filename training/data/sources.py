"""The prepare stage: turn a `dataset` spec into a folder of labelled images on disk."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from training.config import DatasetSpec
from training.data.kaggle import COMPLETE_MARKER, KaggleCredentials, download
from training.data.labels import DatasetError, list_labelled_files
from training.data.manifests import SUFFIXES, is_manifest, lay_out
from training.data.tables import prepare_tables, table_digest, table_pairs, tables_root
from training.storage import file_lock, sha256_file


class DatasetRef(BaseModel):
    """What later stages need to find the images again, and how to tell one version from another."""

    source: str
    labels: str
    root: Path
    """The folder that holds the images (source folder + subdir)."""
    source_root: Path
    class_names: list[str]
    class_counts: dict[str, int]
    image_count: int
    fingerprint: str
    """sha256 over every (path, label, content hash): changes when any file is added,
    removed, relabelled or changed."""


TABLE_LABELS = "table"
"""DatasetRef.labels of a source read into tables (training/data/tables.py)."""


def labelled_files(ref: DatasetRef) -> list[tuple[str, str]]:
    if ref.labels == TABLE_LABELS:
        return table_pairs(ref.root)[0]
    return list_labelled_files(ref.root, ref.labels, ref.source_root)


def source_root(spec: DatasetSpec, home: Path) -> Path:
    """Where the source's files are, without fetching anything."""
    if spec.kind == "builtin":
        return home / "datasets" / "builtin" / spec.source.removeprefix("builtin:")
    if spec.kind == "kaggle":
        kind, ref = spec.kaggle_ref
        return home / "datasets" / "kaggle" / kind / ref.replace("/", "__")
    if spec.kind in ("torchvision", "hf"):
        return tables_root(spec, home)
    return Path(spec.source).expanduser().resolve()


def check_source(spec: DatasetSpec) -> None:
    """The cheap checks that must pass before anything is downloaded or decoded."""
    if spec.kind == "local" and not (Path(spec.source).expanduser().is_dir()
                                     or is_manifest(spec.source)):
        raise DatasetError(
            f"dataset folder {spec.source} does not exist; give an existing folder, a manifest "
            f"file ({', '.join(SUFFIXES)}), "
            '"builtin:digits" or "kaggle:competitions/<slug>"'
        )


def fetch(spec: DatasetSpec, home: Path, credentials: KaggleCredentials | None = None,
          warn=None) -> Path:
    """The source's files on this machine, written or downloaded first where needed: the one
    place a source string becomes a folder (training and predict-flow alike)."""
    check_source(spec)
    root = source_root(spec, home)
    if spec.kind == "builtin":
        write_digits(root)
    elif spec.kind == "kaggle":
        kind, ref = spec.kaggle_ref
        root = download(kind, ref, root, credentials, retries=spec.download_retries,
                        version=spec.version, warn=warn)
    elif spec.kind in ("torchvision", "hf"):
        root = prepare_tables(spec, home)
    elif is_manifest(spec.source):
        root = lay_out(Path(spec.source), home)
    return root


def prepare(spec: DatasetSpec, home: Path, credentials: KaggleCredentials | None = None,
            warn=None) -> DatasetRef:
    root = fetch(spec, home, credentials, warn)
    if spec.kind in ("torchvision", "hf"):
        return _table_ref(spec, root)
    images_root = root / spec.subdir if spec.subdir else root
    pairs = list_labelled_files(images_root, spec.labels, root)
    counts = Counter(label for _, label in pairs)
    return DatasetRef(
        source=spec.source,
        labels=spec.labels,
        root=images_root,
        source_root=root,
        class_names=sorted(counts),
        class_counts=dict(sorted(counts.items())),
        image_count=len(pairs),
        fingerprint=fingerprint(images_root, pairs),
    )


def _table_ref(spec: DatasetSpec, root: Path) -> DatasetRef:
    pairs, names = table_pairs(root)
    counts = Counter(label for _, label in pairs)
    identity = json.dumps([table_digest(root), names, sorted(counts.items())])
    return DatasetRef(source=spec.source, labels=TABLE_LABELS, root=root, source_root=root,
                      class_names=names, class_counts={n: counts[n] for n in names},
                      image_count=len(pairs),
                      fingerprint=hashlib.sha256(identity.encode()).hexdigest())


def fingerprint(root: Path, pairs: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for relpath, label in pairs:
        digest.update(f"{relpath}\t{label}\t{sha256_file(root / relpath)}\n".encode())
    return digest.hexdigest()


def write_digits(root: Path) -> Path:
    """scikit-learn's 1,797 handwritten digits as 8x8 grayscale PNGs, one folder per class.

    Written once, into a staging folder renamed into place, so every later stage runs the same
    code as for downloaded images.
    """
    if (root / COMPLETE_MARKER).is_file():
        return root
    # Several first runs on a fresh home write it at once: one does, under the lock; the
    # others wait and find it whole (before, a second writer replaced the folder under the
    # first's reader).
    with file_lock(root.parent / f".{root.name}.lock"):
        if not (root / COMPLETE_MARKER).is_file():
            _write_digits(root)
    return root


def _write_digits(root: Path) -> None:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        pixels = np.clip(np.rint(digits.images * (255 / 16)), 0, 255).astype(np.uint8)
        for index, (image, target) in enumerate(zip(pixels, digits.target, strict=True)):
            folder = staging / str(target)
            folder.mkdir(exist_ok=True)
            Image.fromarray(image).save(folder / f"digit_{index:04d}.png")
        (staging / COMPLETE_MARKER).write_text("scikit-learn load_digits\n")
        if root.exists():  # an incomplete copy: no reader takes it (no marker)
            shutil.rmtree(root)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["DatasetError", "DatasetRef", "prepare", "check_source", "source_root", "write_digits"]
