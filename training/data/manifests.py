"""A labelling tool's export as the dataset: `dataset.source` names the manifest file.

Read as each tool writes it, without a conversion step:

- CSV or Parquet with a header: the image in `path` (or `file`, `file_name`, `filename`,
  `image`, `image_path`), its class in `label`, an optional `split` column;
- Vertex AI's image classification import CSV (no header): `[ML_USE,]PATH,LABEL`, ML_USE one
  of TRAINING, VALIDATION, TEST;
- JSON Lines: Hugging Face `imagefolder`'s `metadata.jsonl` (`file_name` and the label
  column), SageMaker Ground Truth's output manifest (`source-ref` and the job's label
  attribute, its class name in `<attribute>-metadata.class-name`), or the CSV's keys;
- Label Studio's JSON and JSON-MIN exports (the image and its one chosen class).

Image paths are relative to the manifest's folder, or absolute; Label Studio's
`/data/local-files/?d=<path>` is read as `<path>` under the manifest's folder. The images are
laid out as a folder train-flow already reads, of links to the files (`<home>/datasets/
manifests/<hash>/`): `<class>/<file>`, or `<split>/<class>/<file>` when the manifest names
splits, which are then kept as a folder's given splits are. Nothing is copied.

A row naming a missing image, an unknown split, no class or several classes is an error with
its row number, before anything is decoded.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from training.data.labels import DatasetError
from training.storage import file_lock, sha256_file

SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
PATH_COLUMNS = ("path", "file", "file_name", "filename", "image", "image_path", "source-ref")
SPLITS = {"train": "train", "training": "train", "val": "val", "valid": "val",
          "validation": "val", "test": "test"}
"""The split column's values (any case; Vertex AI writes TRAINING, VALIDATION, TEST)."""
DONE = ".complete"


@dataclass(frozen=True)
class Row:
    number: int
    """1-based, as an editor shows the line (a CSV header is line 1)"""
    path: str
    labels: list[str]
    split: str | None = None


def is_manifest(source: str) -> bool:
    return Path(source).suffix.lower() in SUFFIXES and Path(source).expanduser().is_file()


def read_rows(manifest: Path) -> list[Row]:
    """The manifest's rows, whichever tool wrote it."""
    suffix = manifest.suffix.lower()
    if suffix == ".csv":
        return _csv_rows(manifest)
    if suffix == ".parquet":
        import pandas as pd

        frame = pd.read_parquet(manifest)
        return _keyed_rows(frame.to_dict("records"), first=1)
    if suffix == ".jsonl":
        lines = manifest.read_text(encoding="utf-8").splitlines()
        records = [(n, json.loads(line)) for n, line in enumerate(lines, 1) if line.strip()]
        return [_keyed_row(n, record) for n, record in records]
    tasks = json.loads(manifest.read_text(encoding="utf-8"))
    if not isinstance(tasks, list):
        raise DatasetError(f"{manifest.name}: a JSON manifest is a list of rows (Label Studio's "
                           "JSON or JSON-MIN export); this one is not")
    return [_label_studio_row(n, task) for n, task in enumerate(tasks, 1)]


def _csv_rows(manifest: Path) -> list[Row]:
    with open(manifest, newline="", encoding="utf-8") as f:
        table = [row for row in csv.reader(f) if row]
    if not table:
        raise DatasetError(f"{manifest.name} is empty")
    header = [cell.strip().lower() for cell in table[0]]
    if any(name in header for name in PATH_COLUMNS):
        return _keyed_rows([dict(zip(header, row, strict=False)) for row in table[1:]], first=2)
    rows = []  # Vertex AI's import CSV: [ML_USE,]PATH,LABEL...
    for n, cells in enumerate(table, 1):
        cells = [c.strip() for c in cells]
        split = None
        if cells[0].lower() in SPLITS or cells[0].upper() == "UNASSIGNED":
            split, cells = cells[0], cells[1:]
        if not cells:
            raise DatasetError(f"{manifest.name} row {n}: no image path")
        rows.append(Row(n, cells[0], [c for c in cells[1:] if c], split))
    return rows


def _keyed_rows(records: list[dict], first: int) -> list[Row]:
    return [_keyed_row(n, record) for n, record in enumerate(records, first)]


def _keyed_row(n: int, record: dict) -> Row:
    record = {str(k).lower() if str(k).lower() in (*PATH_COLUMNS, "label", "labels", "split")
              else str(k): v for k, v in record.items()}
    path_key = next((k for k in PATH_COLUMNS if record.get(k)), None)
    if path_key is None:
        raise DatasetError(f"row {n}: no image path (one of {', '.join(PATH_COLUMNS)})")
    if path_key == "source-ref":
        return Row(n, str(record[path_key]), _ground_truth_labels(record), record.get("split"))
    if "labels" in record and record["labels"] not in (None, ""):
        value = record["labels"]
        labels = [str(v) for v in value] if isinstance(value, list | tuple) else [
            s.strip() for s in str(value).replace(";", ",").split(",") if s.strip()]
    elif "label" in record and record["label"] not in (None, ""):
        labels = [str(record["label"])]
    else:  # Hugging Face metadata.jsonl: the one other column holds the class
        others = [k for k, v in record.items() if k not in (path_key, "split", "label", "labels")
                  and isinstance(v, str | int) and v != ""]
        labels = [str(record[others[0]])] if len(others) == 1 else []
    split = record.get("split")
    return Row(n, str(record[path_key]), labels, str(split) if split not in (None, "") else None)


def _ground_truth_labels(record: dict) -> list[str]:
    """SageMaker Ground Truth's classes: the label attribute's `<attribute>-metadata` holds
    `class-name` (one class) or `class-map` (multi-label: index -> name of each given)."""
    for key, meta in record.items():
        if key.endswith("-metadata") and isinstance(meta, dict):
            if "class-map" in meta:
                return [str(name) for name in meta["class-map"].values()]
            if meta.get("class-name"):
                return [str(meta["class-name"])]
    return []


def _label_studio_row(n: int, task: dict) -> Row:
    data = task.get("data", task)
    image = data.get("image") or next((v for v in data.values() if isinstance(v, str)
                                       and Path(urlparse(v).path).suffix), None)
    if "annotations" in task:  # the JSON export: the first annotation's choices
        results = [r for a in task["annotations"] for r in a.get("result", [])
                   if r.get("type") == "choices"]
        labels = results[0]["value"]["choices"] if results else []
    else:  # JSON-MIN: the control's name is the key ("choice" by default)
        chosen = task.get("choice", task.get("label"))
        labels = (chosen.get("choices", []) if isinstance(chosen, dict)
                  else [chosen] if chosen else [])
    if image is None:
        raise DatasetError(f"row {n}: no image in the Label Studio task")
    query = parse_qs(urlparse(image).query)
    path = query["d"][0] if "d" in query else image
    return Row(n, path, [str(label) for label in labels], task.get("split"))


def image_file(manifest: Path, path: str, number: int) -> Path:
    parsed = urlparse(path)
    if parsed.scheme in ("s3", "gs", "gcs", "az", "abfs", "http", "https"):
        raise DatasetError(
            f"{manifest.name} row {number}: {path} is in object storage or on the web; images "
            "are read from this machine's disks only (copy them next to the manifest and name "
            "them relative to it)")
    local = Path(parsed.path if parsed.scheme == "file" else path).expanduser()
    file = local if local.is_absolute() else manifest.parent / local
    if not file.is_file() and path.startswith("/data/upload/"):  # Label Studio's uploads
        file = manifest.parent / Path(path).name
    if not file.is_file():
        raise DatasetError(f"{manifest.name} row {number}: image {path} does not exist "
                           f"(looked for {file})")
    return file.resolve()


def lay_out(manifest: Path, home: Path) -> Path:
    """The manifest's images as a folder of links (see the module's text); its path."""
    manifest = manifest.expanduser().resolve()
    rows = read_rows(manifest)
    if not rows:
        raise DatasetError(f"{manifest.name} has no rows")
    files = [image_file(manifest, row.path, row.number) for row in rows]
    _check(manifest, rows)
    named = any(row.split for row in rows)
    digest = hashlib.sha256(sha256_file(manifest).encode() + str(manifest).encode())
    folder = home / "datasets" / "manifests" / digest.hexdigest()[:16]
    if (folder / DONE).is_file():
        return folder
    with file_lock(folder.parent / f".{folder.name}.lock"):
        if (folder / DONE).is_file():
            return folder
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=_made(folder.parent)))
        try:
            for row, file in zip(rows, files, strict=True):
                where = staging / (SPLITS[row.split.lower()] if named else "") / row.labels[0]
                where.mkdir(parents=True, exist_ok=True)
                link = where / _flat_name(manifest.parent, file)
                if not link.exists():
                    os.symlink(file, link)
            (staging / DONE).write_text(f"{manifest}\n")
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _flat_name(base: Path, file: Path) -> str:
    """The file's path under the manifest's folder as one name (a/b/c.jpg -> a__b__c.jpg)."""
    try:
        relative = file.relative_to(base.resolve())
    except ValueError:
        relative = Path(hashlib.sha256(str(file.parent).encode()).hexdigest()[:8]) / file.name
    return "__".join(relative.parts)


def _check(manifest: Path, rows: list[Row]) -> None:
    for row in rows:
        if not row.labels:
            raise DatasetError(f"{manifest.name} row {row.number}: {row.path} has no class")
        if len(row.labels) > 1:
            raise DatasetError(
                f"{manifest.name} row {row.number}: {row.path} has {len(row.labels)} classes "
                f"({', '.join(row.labels)}); several classes per image are not trained yet: "
                "keep one per row")
        if row.split is not None and row.split.lower() not in SPLITS:
            raise DatasetError(
                f"{manifest.name} row {row.number}: split {row.split!r} is not one of train, "
                "val, test (or TRAINING, VALIDATION, TEST)")
    with_split = [row for row in rows if row.split]
    if with_split and len(with_split) != len(rows):
        bare = next(row for row in rows if not row.split)
        raise DatasetError(f"{manifest.name} row {bare.number}: no split, where other rows "
                           "name one; name a split on every row or on none")
