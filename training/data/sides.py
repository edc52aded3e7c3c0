"""The side each split is decoded at: shared by the split stage (in the flow's process, which
never imports torch) and the ranks that read the decode store."""

from __future__ import annotations

from training.config import TrainingSpec

# Random crops are cut from a slightly larger image, as ImageNet training does (256 -> 224).
CROP_MARGIN = 8 / 7


def cache_side(image_size: int, augment: bool) -> int:
    """The cached side: a margin to crop from when augmenting, else the input size itself."""
    return round(image_size * CROP_MARGIN) if augment else image_size


def split_sides(spec: TrainingSpec) -> dict[str, int]:
    """The side each split is decoded at for a training with this spec."""
    return {"train": cache_side(spec.image_size, spec.augment != "none"),
            "val": spec.image_size, "test": spec.image_size}
