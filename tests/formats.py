"""Small files in the real formats of the datasets users hold: MNIST's IDX files in
torchvision's folder layout, CIFAR-10's pickled batches, a Hugging Face parquet dataset."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck"]


def digit_like(label: int, index: int, side: int = 28, classes: int = 10) -> np.ndarray:
    """A class-dependent bar with noise: learnable, and every image different."""
    rng = np.random.default_rng(label * 100_003 + index)
    image = rng.integers(0, 40, (side, side), dtype=np.uint8)
    top = 1 + label * (side - 4) // classes
    image[top:top + 3, 3:side - 3] = 180 + rng.integers(0, 70)
    return image


def write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(magic.to_bytes(4, "big"))
        for size in array.shape:
            f.write(int(size).to_bytes(4, "big"))
        f.write(np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist(root: Path, train: int, test: int, name: str = "MNIST"
                ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`train` and `test` images, classes in turn, as <root>/<name>/raw/*-ubyte; returns
    split -> (images, labels)."""
    written = {}
    for split, count in (("train", train), ("test", test)):
        labels = np.arange(count) % 10
        offset = 0 if split == "train" else 1_000_000
        images = np.stack([digit_like(int(label), offset + i) for i, label in enumerate(labels)])
        image_file, label_file = MNIST_FILES[split]
        write_idx(root / name / "raw" / image_file, images, 0x0803)
        write_idx(root / name / "raw" / label_file, labels, 0x0801)
        written[split] = (images, labels)
    return written


def write_cifar10(root: Path, per_batch: int, test: int) -> dict[str, tuple[np.ndarray, list]]:
    """cifar-10-batches-py/ as CIFAR-10 ships it: five training batches, a test batch and the
    class names, pickled; returns split -> (images [N, 32, 32, 3], labels)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, tuple[list, list]] = {"train": ([], []), "test": ([], [])}
    batches = [(f"data_batch_{i}", "train", per_batch) for i in range(1, 6)]
    for n, (file, split, count) in enumerate([*batches, ("test_batch", "test", test)]):
        labels = [i % 10 for i in range(count)]
        images = np.stack([np.stack([digit_like(label, n * 1000 + i, 32)] * 3, axis=-1)
                           for i, label in enumerate(labels)])
        images[..., 0] //= 2  # not gray: the channels differ
        rows = images.transpose(0, 3, 1, 2).reshape(count, -1)
        with open(folder / file, "wb") as f:
            pickle.dump({b"batch_label": file.encode(), b"labels": labels, b"data": rows,
                         b"filenames": [f"{i}.png".encode() for i in range(count)]}, f, protocol=2)
        written[split][0].append(images)
        written[split][1].extend(labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [n.encode() for n in CIFAR_NAMES],
                     b"num_cases_per_batch": per_batch, b"num_vis": 3072}, f, protocol=2)
    return {split: (np.concatenate(images), labels) for split, (images, labels) in written.items()}


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def write_hf_parquet(folder: Path, counts: dict[str, int], names: list[str],
                     image_column: str = "image", label_column: str = "label") -> dict[str, list]:
    """A Hugging Face dataset as the Hub stores one: data/<split>-00000-of-00001.parquet with
    an Image column of PNG bytes and a ClassLabel column; returns split -> [(png, label)]."""
    import datasets

    features = datasets.Features({image_column: datasets.Image(),
                                  label_column: datasets.ClassLabel(names=names)})
    written = {}
    for n, (split, count) in enumerate(counts.items()):
        rows = [(png(np.stack([digit_like(i % len(names), n * 10_000 + i, 20, len(names))] * 3,
                              axis=-1)), i % len(names)) for i in range(count)]
        table = datasets.Dataset.from_dict(
            {image_column: [{"bytes": b, "path": None} for b, _ in rows],
             label_column: [label for _, label in rows]}, features=features)
        (folder / "data").mkdir(parents=True, exist_ok=True)
        table.to_parquet(folder / "data" / f"{split}-00000-of-00001.parquet")
        written[split] = rows
    return written
