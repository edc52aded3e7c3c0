"""torchvision's catalogue and Hugging Face datasets as tables of rows (training/data/rows.py).

Each source is read once into one container per split, never one file per image:

    <home>/datasets/tables/<kind>/<name>-<where>/
        table.json              {"digest": ..., "class_names": [...], "counts": {split: n}}
        train/images.npy        (or images.bin + images.offsets.npy, or files.txt)
        train/labels.npy        int64 [N]
        test/...                the source's own test split, kept as the test split
                                (a Hugging Face dataset without one: test is carved)

Array-backed data (MNIST's IDX files, CIFAR's batches) becomes one uint8 array per split;
encoded images (parquet bytes) stay encoded, back to back; a catalogue's own image files
stay where they are, listed. The split stage then treats `train/` and `test/` as a folder
that comes split: the given test set is the test set, and val is carved from train.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import pickle
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from training.config import DatasetSpec
from training.data.labels import DatasetError
from training.data.rows import ARRAY, CONTAINERS, ENCODED, FILES, row_path
from training.storage import file_lock

TABLE = "table.json"
IDX_MAGIC = {"images": 0x0803, "labels": 0x0801}  # unsigned bytes, 3 and 1 dimensions


@dataclass
class Table:
    """One split of a source: its images in one container, and a label index per row."""

    labels: np.ndarray
    images: np.ndarray | None = None
    """uint8 [N, H, W] or [N, H, W, 3]."""
    encoded: list[bytes] | None = None
    files: list[str] | None = None


def tables_root(spec: DatasetSpec, home: Path) -> Path:
    where = hashlib.sha256(str(torchvision_root(spec, home)).encode()).hexdigest()[:8] \
        if spec.kind == "torchvision" else hashlib.sha256(spec.name.encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name.strip("/"))[-60:]
    return home / "datasets" / "tables" / spec.kind / f"{name}-{where}"


def torchvision_root(spec: DatasetSpec, home: Path) -> Path:
    return (Path(spec.root).expanduser().resolve() if spec.root
            else home / "datasets" / "torchvision")


def prepare_tables(spec: DatasetSpec, home: Path, warn: Callable[[str], None] = print) -> Path:
    """The source's tables, read from the source only when it changed since the last run."""
    out = tables_root(spec, home)
    if spec.kind == "torchvision":
        digest, read = _torchvision(spec, home)
    else:
        digest, read = _huggingface(spec)
    def current() -> bool:
        return (out / TABLE).is_file() and json.loads((out / TABLE).read_text())["digest"] == digest

    if current():
        return out
    # First runs at once on a fresh home: one reads and writes, the others wait and reuse
    # its tables (a second writer would replace the folder under the first one's reader).
    with file_lock(out.parent / f".{out.name}.lock"):
        if not current():
            splits, class_names = read()
            _check_labels(spec, splits, class_names)
            write_tables(out, splits, class_names, digest)
    return out


def write_tables(out: Path, splits: dict[str, Table], class_names: list[str], digest: str) -> None:
    """Every split's container, written beside the old tables and renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for split, table in splits.items():
            folder = staging / split
            folder.mkdir()
            np.save(folder / "labels.npy", table.labels.astype(np.int64))
            if table.images is not None:
                np.save(folder / ARRAY, np.ascontiguousarray(table.images, dtype=np.uint8))
            elif table.encoded is not None:
                with open(folder / ENCODED, "wb") as f:
                    for data in table.encoded:
                        f.write(data)
                np.save(folder / "images.offsets.npy",
                        np.concatenate([[0], np.cumsum([len(d) for d in table.encoded])]))
            else:
                (folder / FILES).write_text("".join(f"{p}\n" for p in table.files))
        counts = {split: len(table.labels) for split, table in splits.items()}
        (staging / TABLE).write_text(json.dumps(
            {"digest": digest, "class_names": class_names, "counts": counts}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def table_pairs(root: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(row path, class name) for every row of every split, and the class names in order."""
    table = json.loads((root / TABLE).read_text())
    names = table["class_names"]
    pairs = []
    for split in table["counts"]:
        folder = root / split
        container = next(c for c in CONTAINERS if (folder / c).is_file())
        labels = np.load(folder / "labels.npy")
        pairs += [(row_path(split, container, i), names[label]) for i, label in enumerate(labels)]
    return pairs, names


def table_digest(root: Path) -> str:
    return json.loads((root / TABLE).read_text())["digest"]


def _check_labels(spec: DatasetSpec, splits: dict[str, Table], class_names: list[str]) -> None:
    if "train" not in splits:
        raise DatasetError(f"{spec.source} has the splits {', '.join(splits) or 'none'}; it "
                           "needs a train split (without a test split, test is carved from it)")
    for split, table in splits.items():
        if len(table.labels) == 0:
            raise DatasetError(f"the {split} split of {spec.source} is empty")
        bad = (table.labels < 0) | (table.labels >= len(class_names))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DatasetError(
                f"the {split} split of {spec.source} has {int(bad.sum())} labels outside the "
                f"{len(class_names)} classes, first {int(table.labels[row])} at row {row}; fix "
                "the labels or the class list")


def _message(error: Exception) -> str:
    """The line of an error that says what went wrong (urllib's and the hub's are long)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _file_digest(folder: Path) -> str:
    """What the files under `folder` are, by name, size and modification time."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# torchvision -------------------------------------------------------------------------------

def _torchvision(spec: DatasetSpec, home: Path):
    name, _, variant = spec.name.partition("/")
    root = torchvision_root(spec, home)
    root.mkdir(parents=True, exist_ok=True)
    if (found := _files_at_hand(name, variant, root)) is not None:
        return found
    import torchvision.datasets as catalogue

    cls = getattr(catalogue, name)
    if issubclass(cls, catalogue.MNIST):
        raw = root / cls.__name__ / "raw"  # torchvision's raw_folder
        needed = _mnist_files(cls, raw, variant)
        if not all(p.is_file() for p in needed) or not needed:
            _download(lambda: _construct(cls, root, variant, train=True), root, needed, spec)
        return (_file_digest(raw) + variant,
                lambda: _read_mnist(cls, root, needed, variant))
    if issubclass(cls, catalogue.CIFAR10):
        folder = root / cls.base_folder
        needed = [folder / n for n, _ in cls.train_list + cls.test_list] + \
                 [folder / cls.meta["filename"]]
        if not all(p.is_file() for p in needed):
            _download(lambda: cls(str(root), train=True, download=True), root, needed, spec)
        return _file_digest(folder), lambda: _read_cifar(cls, folder)
    return _file_digest(root) + variant, lambda: _read_catalogue(cls, root, variant, spec)


IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
"""The files MNIST's `_load_data` reads, and every subclass that keeps it."""


def _files_at_hand(name: str, variant: str, root: Path):
    """A plain MNIST- or CIFAR-layout dataset already on disk, read without importing
    torchvision: its import brings torch's (about 2 s, more than reading 70,000 digits), and
    the flow's process needs neither. Anything else, or a missing file, goes through
    torchvision's class."""
    layout = None if variant else _plain_layout(name)
    if layout is None:
        return None
    if layout.root == "MNIST":
        raw = root / name / "raw"
        needed = [raw / file for pair in IDX_FILES.values() for file in pair]
        if (root / name / "processed").exists() or not all(p.is_file() for p in needed):
            return None  # torchvision's own legacy files, or a download to make
        return _file_digest(raw), lambda: _read_idx(raw, list(layout.classes))
    folder = root / layout.base_folder
    needed = [folder / n for n, _ in layout.train_list + layout.test_list] + \
             [folder / layout.meta["filename"]]
    if not all(p.is_file() for p in needed):
        return None
    return _file_digest(folder), lambda: _read_cifar(layout, folder)


# What a class may not define for its constants to say all about its files: its own loading.
_LOADING = {"__init__", "_load_data", "_load_meta", "_check_exists", "_check_legacy_exist",
            "raw_folder"}


@cache
def _plain_layout(name: str) -> SimpleNamespace | None:
    """The class-level constants of torchvision's `MNIST`, `CIFAR10` or a subclass of them in
    the same module that loads its files the same way (FashionMNIST, KMNIST, CIFAR100), read
    from torchvision's source; None for any other class (EMNIST, QMNIST load their own)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for module, root in (("mnist", "MNIST"), ("cifar", "CIFAR10")):
        path = Path(spec.submodule_search_locations[0]) / "datasets" / f"{module}.py"
        if not path.is_file():
            return None
        classes = {node.name: node for node in ast.parse(path.read_text(encoding="utf-8")).body
                   if isinstance(node, ast.ClassDef)}
        if name not in classes:
            continue
        chain = [classes[name]]
        while chain[-1].name != root:
            bases = [b.id for b in chain[-1].bases if isinstance(b, ast.Name)]
            if not bases or bases[0] not in classes:
                return None
            chain.append(classes[bases[0]])
        constants: dict = {"root": root}
        for node in reversed(chain):
            if node is not chain[-1] and any(isinstance(item, ast.FunctionDef)
                                             and item.name in _LOADING for item in node.body):
                return None
            for item in node.body:
                target = (item.targets[0] if isinstance(item, ast.Assign) and len(item.targets) == 1
                          else item.target if isinstance(item, ast.AnnAssign) else None)
                if isinstance(target, ast.Name) and item.value is not None:
                    try:
                        constants[target.id] = ast.literal_eval(item.value)
                    except ValueError:
                        constants.pop(target.id, None)
        needed = ("classes",) if root == "MNIST" else ("base_folder", "train_list", "test_list",
                                                       "meta")
        return SimpleNamespace(**constants) if all(k in constants for k in needed) else None
    return None


def _read_idx(raw: Path, classes: list[str]):
    """MNIST's train and t10k IDX files, as torchvision's `_load_data` reads them."""
    splits = {}
    for part, (image_file, label_file) in IDX_FILES.items():
        images, labels = read_idx(raw / image_file, "images"), read_idx(raw / label_file, "labels")
        if len(images) != len(labels):
            raise DatasetError(f"{raw / image_file} holds {len(images)} images and "
                               f"{raw / label_file} {len(labels)} labels; they must match")
        splits[part] = Table(labels=labels.astype(np.int64), images=images)
    return splits, classes


def _mnist_files(cls, raw: Path, variant: str) -> list[Path]:
    """The IDX files of unsigned bytes torchvision's class reads (none listed for QMNIST,
    whose files torchvision checks itself)."""
    import torchvision.datasets as catalogue

    if issubclass(cls, catalogue.EMNIST):
        if variant not in cls.splits:
            raise DatasetError('torchvision:EMNIST needs one of its splits, e.g. '
                               f'"torchvision:EMNIST/balanced" ({", ".join(cls.splits)})')
        return [raw / f"emnist-{variant}-{part}-{kind}" for part in ("train", "test")
                for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]
    if isinstance(cls.resources, dict):
        return []
    return [raw / Path(url).name.removesuffix(".gz") for url, _ in cls.resources]


def _construct(cls, root: Path, variant: str, **split):
    kwargs = {"download": True, **split}
    if variant:
        kwargs["split"] = variant
    return cls(str(root), **kwargs)


def _download(construct, root: Path, needed: list[Path], spec: DatasetSpec) -> None:
    """torchvision's own download, or an error naming the files an offline copy needs."""
    try:
        construct()
    except Exception as e:  # noqa: BLE001 - torchvision raises what urllib and its checks raise
        missing = [str(p.relative_to(root)) for p in needed if not p.is_file()]
        raise DatasetError(
            f"{spec.source}: torchvision could not download it ({_message(e)[:200]}) "
            f"and {root} lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; "
            "put a copy of those files there (dataset.root names the folder), or run where the "
            "network reaches the dataset's host") from e
    missing = [p for p in needed if not p.is_file()]
    if missing:
        raise DatasetError(f"{spec.source}: {missing[0]} is missing after the download")


def check_idx(path: Path, kind: str) -> int:
    """An IDX file (MNIST's format) of unsigned bytes, checked before torchvision reads it;
    returns how many items it holds."""
    return _idx_shape(path, kind)[0][0]


def read_idx(path: Path, kind: str) -> np.ndarray:
    """An IDX file of unsigned bytes, checked, as a uint8 array of its shape."""
    shape, offset = _idx_shape(path, kind)
    return np.fromfile(path, dtype=np.uint8, offset=offset).reshape(shape)


def _idx_shape(path: Path, kind: str) -> tuple[tuple[int, ...], int]:
    """The shape an IDX file's header gives, and where its data starts."""
    with open(path, "rb") as f:
        header = f.read(4)
        magic = int.from_bytes(header, "big") if len(header) == 4 else -1
        if magic != IDX_MAGIC[kind]:
            raise DatasetError(
                f"{path} is not an IDX file of {kind}: its magic number is "
                f"{'missing' if magic < 0 else f'0x{magic:08x}'}, expected "
                f"0x{IDX_MAGIC[kind]:08x}; replace it with the dataset's original file")
        dims = magic & 0xFF
        shape = tuple(int.from_bytes(f.read(4), "big") for _ in range(dims))
    size = path.stat().st_size - 4 * (1 + dims)
    if size != int(np.prod(shape)):
        raise DatasetError(f"{path} is truncated: its header says {shape}, it holds "
                           f"{size} bytes of the {int(np.prod(shape))} that needs; "
                           "replace it with the dataset's original file")
    return shape, 4 * (1 + dims)


def _read_mnist(cls, root: Path, files: list[Path], variant: str):
    for images in (f for f in files if "images-idx3" in f.name):
        labels = images.with_name(images.name.replace("images-idx3", "labels-idx1"))
        count, labelled = check_idx(images, "images"), check_idx(labels, "labels")
        if count != labelled:
            raise DatasetError(f"{images} holds {count} images and {labels} {labelled} "
                               "labels; they must match")
    # torchvision's class is the reference for classes and for any dataset-specific fixes
    # (QMNIST's extra columns); the IDX files were checked above.
    splits = {}
    for part, train in (("train", True), ("test", False)):
        ds = _construct(cls, root, variant, train=train)
        splits[part] = Table(labels=_labels(ds.targets), images=np.asarray(ds.data))
    return splits, list(ds.classes)


def _labels(targets) -> np.ndarray:
    labels = np.asarray(targets)
    return labels[:, 0] if labels.ndim == 2 else labels  # QMNIST keeps metadata beside the class


class _ArraysOnly(pickle.Unpickler):
    """CIFAR's batches are pickles: only numpy arrays and plain containers may come out."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # how protocol 2 writes bytes

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a data batch")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _ArraysOnly(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise DatasetError(f"{path} is not a CIFAR batch ({e}); replace it with the dataset's "
                           "original file") from e
    if not isinstance(batch, dict):
        raise DatasetError(f"{path} is not a CIFAR batch (it holds a {type(batch).__name__})")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def _read_cifar(cls, folder: Path):
    meta = _unpickle(folder / cls.meta["filename"])
    names = [n.decode() if isinstance(n, bytes) else n for n in meta[cls.meta["key"]]]
    splits = {}
    for part, files in (("train", cls.train_list), ("test", cls.test_list)):
        data, labels = [], []
        for file, _ in files:
            batch = _unpickle(folder / file)
            key = "labels" if "labels" in batch else "fine_labels"
            if "data" not in batch or key not in batch:
                raise DatasetError(f"{folder / file} has no data or labels entry; replace it "
                                   "with the dataset's original file")
            data.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels += list(batch[key])
        splits[part] = Table(labels=np.asarray(labels, dtype=np.int64),
                             images=np.concatenate(data).transpose(0, 2, 3, 1))
    return splits, names


def _read_catalogue(cls, root: Path, variant: str, spec: DatasetSpec):
    """Any other torchvision class: by its own train/test argument, arrays or image files."""
    parameters = inspect.signature(cls).parameters
    splits = {}
    for part in ("train", "test"):
        if "train" in parameters:
            args = {"train": part == "train"}
        elif "split" in parameters:
            args = {"split": part}
        else:
            raise DatasetError(f"{spec.source} has no train/test argument; use a folder or an "
                               '"hf:" source for it')
        try:
            ds = cls(str(root), download=True, **args) if "download" in parameters \
                else cls(str(root), **args)
        except Exception as e:  # noqa: BLE001 - torchvision's own errors, named below
            raise DatasetError(f"{spec.source} could not be loaded from {root}: "
                               f"{_message(e)[:300]}; put a copy there "
                               "(dataset.root names the folder) or run where the network "
                               "reaches it") from e
        splits[part] = _catalogue_table(ds, spec)
    classes = getattr(ds, "classes", None) or \
        [str(i) for i in range(int(max(t.labels.max() for t in splits.values())) + 1)]
    return splits, list(classes)


def _catalogue_table(ds, spec: DatasetSpec) -> Table:
    labels = getattr(ds, "targets", None)
    if labels is None:
        labels = getattr(ds, "labels", None) or getattr(ds, "_labels", None)
    data = getattr(ds, "data", None)
    if labels is not None and isinstance(data, np.ndarray) and data.dtype == np.uint8:
        if data.ndim == 4 and data.shape[1] in (1, 3) and data.shape[-1] not in (1, 3):
            data = data.transpose(0, 2, 3, 1)  # SVHN and STL10 store channels first
        if data.ndim == 4 and data.shape[-1] == 1:
            data = data[..., 0]
        return Table(labels=_labels(labels), images=data)
    files = getattr(ds, "_image_files", None) or getattr(ds, "_images", None)
    if labels is not None and files is not None and len(files) == len(labels):
        return Table(labels=_labels(labels), files=[str(Path(f).resolve()) for f in files])
    raise DatasetError(f"{spec.source} is not an image classification dataset this flow "
                       "can read (no image array or files with labels); use a folder or an "
                       '"hf:" source for it')


# Hugging Face ------------------------------------------------------------------------------

HF_SPLITS = {"train": "train", "validation": "val", "valid": "val", "val": "val", "test": "test"}


def _huggingface(spec: DatasetSpec):
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(f'{spec.source} needs the datasets library: pip install '
                           '"trainflow[hf]"') from e
    name = spec.name
    local = Path(name).expanduser()
    try:
        loaded = datasets.load_dataset(str(local.resolve()) if local.exists() else name)
    except Exception as e:  # noqa: BLE001 - the hub's and the builders' errors, named below
        raise DatasetError(f"{spec.source} could not be loaded: {_message(e)[:300]}; "
                           "give a dataset on the Hugging Face Hub or a local folder of parquet "
                           "or arrow files (offline: a folder, or the datasets cache)") from e
    unknown = [s for s in loaded if s not in HF_SPLITS]
    if unknown:
        raise DatasetError(f"{spec.source} has the splits {', '.join(loaded)}; rename "
                           f"{unknown[0]!r} to train, validation or test")
    first = next(iter(loaded.values()))
    for column in (spec.image_column, spec.label_column):
        if column not in first.features:
            raise DatasetError(
                f"{spec.source} has no column {column!r} (it has {', '.join(first.features)}); "
                "set dataset.image_column and dataset.label_column")
    digest = hashlib.sha256(json.dumps(
        [spec.image_column, spec.label_column,
         # datasets has no public content hash; its fingerprint follows the data files, held
         # so by tests/test_library_internals.py
         {s: d._fingerprint for s, d in loaded.items()}], sort_keys=True).encode()).hexdigest()
    return digest, lambda: _read_hf(loaded, spec)


def _read_hf(loaded, spec: DatasetSpec):
    import datasets

    feature = next(iter(loaded.values())).features[spec.label_column]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        to_index = None
    else:
        values = sorted({str(v) for d in loaded.values() for v in d[spec.label_column]})
        names, to_index = values, {v: i for i, v in enumerate(values)}
    splits = {}
    for split, ds in loaded.items():
        ds = ds.cast_column(spec.image_column, datasets.Image(decode=False))
        column = ds[spec.image_column]
        labels = ds[spec.label_column]
        labels = np.asarray([to_index[str(v)] for v in labels] if to_index else labels,
                            dtype=np.int64)
        splits[HF_SPLITS[split]] = Table(labels=labels, encoded=[_encoded(v) for v in column])
    return splits, names


def _encoded(value: dict) -> bytes:
    if value.get("bytes"):
        return value["bytes"]
    if value.get("path"):
        return Path(value["path"]).read_bytes()
    return b""  # an empty image: the split stage quarantines it, as a broken file


__all__ = ["prepare_tables", "table_pairs", "table_digest", "check_idx", "read_idx",
           "write_tables"]
