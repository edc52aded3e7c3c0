"""Reading (file, label) pairs from the three label layouts."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path

from trainflow_serving.images import IMAGE_EXTENSIONS


class DatasetError(ValueError):
    """Bad dataset input; the message names the problem and the fix."""


def list_labelled_files(images_root: Path, labels: str, source_root: Path) -> list[tuple[str, str]]:
    """Sorted (path relative to images_root, label) pairs for the chosen layout."""
    if not images_root.is_dir():
        raise DatasetError(
            f"image folder {images_root} does not exist; check dataset.source and dataset.subdir"
        )
    if labels == "folders":
        pairs = _from_folders(images_root)
    elif labels == "filename":
        pairs = _from_filenames(images_root)
    else:
        pairs = _from_csv(images_root, source_root / labels.removeprefix("csv:"))
    if not pairs:
        raise DatasetError(
            f"no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}) found under {images_root} "
            f'with labels="{labels}"'
        )
    return sorted(pairs)


def _is_candidate(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and (
        path.suffix.lower() in IMAGE_EXTENSIONS
    )


GIVEN_SPLITS = {"train": "train", "val": "val", "valid": "val", "validation": "val",
                "test": "test"}
SPLIT_LIKE = frozenset(GIVEN_SPLITS) | {"training", "testing", "eval", "evaluation", "holdout"}
"""Folder names that say "a split", never "a class"."""


def given_splits(root: Path) -> dict[str, str] | None:
    """{folder: split} when `root` comes split, each folder holding one folder per class; else
    None. The layouts as people download them:

    - train/ and test/, optionally one of val/, valid/ or validation/: each is its split;
    - train/ and one of val/, valid/ or validation/ without test/ (the PyTorch transfer-learning
      tutorial's hymenoptera_data, many Kaggle sets): the held-out folder is the *test* split,
      so the figures are comparable with the ones published for it, and the epoch is chosen on
      a val carved from train.
    """
    if not root.is_dir():
        return None
    folders = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    held_out = {f for f in folders if GIVEN_SPLITS.get(f) in ("val", "test")}
    if "train" not in folders or not held_out or not folders <= GIVEN_SPLITS.keys():
        return None
    if sum(GIVEN_SPLITS[f] == "val" for f in folders) > 1:
        raise DatasetError(f"{root} has more than one validation folder "
                           f"({', '.join(sorted(f for f in folders if GIVEN_SPLITS[f] == 'val'))}"
                           "); keep one")
    if "test" not in folders:
        return {folder: "train" if folder == "train" else "test" for folder in sorted(folders)}
    return {folder: GIVEN_SPLITS[folder] for folder in sorted(folders)}


def refuse_split_like_classes(root: Path, class_names: list[str]) -> None:
    """Folders named like splits read as classes would train a model to tell the folders
    apart; say what layout was expected instead."""
    split_like = sorted(n for n in class_names if n.lower() in SPLIT_LIKE)
    if not split_like:
        return
    others = sorted(set(class_names) - set(split_like))
    named = ", ".join(f"{n}/" for n in split_like)
    if "train" not in (n.lower() for n in split_like):
        why = "there is no train/ beside them"
    elif others:
        why = f"other folders stand beside them ({', '.join(f'{n}/' for n in others[:5])})"
    else:
        why = "no held-out folder (test/, val/, valid/ or validation/) stands beside train/"
    raise DatasetError(
        f"{root} has folders named like splits ({named}), which would be read as classes, but "
        f"not the layout of a split dataset: {why}. Use train/ with test/ and/or val/ (one "
        "folder per class in each), point dataset.source (or dataset.subdir) at the folder "
        "that holds the class folders, or rename them")


def _from_folders(root: Path) -> list[tuple[str, str]]:
    if (given := given_splits(root)) is not None:
        pairs = []
        for folder in given:
            found = _from_class_folders(root, root / folder)
            if not found:
                raise DatasetError(f"split folder {root / folder} has no images in class "
                                   "folders; add them (one folder per class), or remove it")
            pairs += found
        return pairs
    pairs = _from_class_folders(root, root)
    refuse_split_like_classes(root, sorted({label for _, label in pairs}))
    return pairs


def _image_files(folder: str) -> Iterator[str]:
    """Every candidate image under `folder`, following links as `Path.rglob` does; os.scandir
    reads each entry's type with the listing, where pathlib's rglob + is_file stat every file
    again (25,000 files: 1.0 s of watch-data's 1.3 s)."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                yield from _image_files(entry.path)
            elif (entry.is_file() and not entry.name.startswith(".")
                  and os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS):
                yield entry.path


def _from_class_folders(root: Path, classes: Path) -> list[tuple[str, str]]:
    pairs = []
    prefix = len(str(root)) + 1
    for class_dir in sorted(p for p in classes.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for path in _image_files(str(class_dir)):
            pairs.append((path[prefix:].replace(os.sep, "/"), class_dir.name))
    if not pairs and any(_is_candidate(p) for p in classes.iterdir()):
        raise DatasetError(
            f'{classes} holds images directly, not in one sub-folder per class: use labels="filename" '
            '(cat.12.jpg -> cat) or labels="csv:<file>"'
        )
    return pairs


def _from_filenames(root: Path) -> list[tuple[str, str]]:
    pairs = []
    for path in root.iterdir():
        if _is_candidate(path):
            label, sep, _ = path.name.partition(".")
            if not sep or not label:
                raise DatasetError(f"cannot read a label from file name {path.name!r}")
            pairs.append((path.name, label))
    return pairs


def _from_csv(root: Path, csv_path: Path) -> list[tuple[str, str]]:
    if not csv_path.is_file():
        raise DatasetError(f"label file {csv_path} does not exist; check dataset.labels")
    with open(csv_path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = set(reader.fieldnames or [])
        if not {"file", "label"} <= columns:
            raise DatasetError(
                f"{csv_path.name} must have columns file,label; it has "
                f"{','.join(reader.fieldnames or []) or 'none'}"
            )
        rows = [(row["file"].strip(), row["label"].strip()) for row in reader]
    missing = [name for name, _ in rows if not (root / name).is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DatasetError(f"{csv_path.name} names {len(missing)} files missing under {root}: {shown}")
    outside = [name for name, _ in rows if ".." in Path(name).parts or Path(name).is_absolute()]
    if outside:
        raise DatasetError(f"{csv_path.name} names files outside {root}: {', '.join(outside[:5])}")
    empty = [name for name, label in rows if not label]
    if empty:
        raise DatasetError(f"{csv_path.name} has rows with an empty label: {', '.join(empty[:5])}")
    return rows
