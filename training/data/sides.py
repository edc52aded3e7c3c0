"""The geometry each split is decoded at: shared by the split stage (in the flow's process,
which never imports torch) and the ranks that read the decode store."""

from __future__ import annotations

from trainflow_serving.images import Geometry
from training.config import TrainingSpec

# Random crops are cut from a slightly larger image, and evaluation's centre crop from the
# same resize, as ImageNet training does (256 -> 224).
CROP_MARGIN = 8 / 7


def cache_side(image_size: int, augment: bool) -> int:
    """The cached side: a margin to crop from when augmenting, else the input size itself."""
    return round(image_size * CROP_MARGIN) if augment else image_size


def evaluation_geometry(spec: TrainingSpec) -> Geometry:
    """What evaluation, scoring and the served model see: the whole image squashed, or (fit
    "crop") the shorter side resized to 8/7 of the input and the centre cut out."""
    if spec.fit == "squash":
        return Geometry(spec.image_size)
    return Geometry(spec.image_size, round(spec.image_size * CROP_MARGIN))


def split_sides(spec: TrainingSpec) -> dict[str, Geometry]:
    """The geometry each split is decoded at for a training with this spec: training's random
    crops are cut from a square of the larger side (with fit "crop", the centre square of
    the same resize evaluation uses)."""
    evaluation = evaluation_geometry(spec)
    if spec.augment == "none":
        train = evaluation
    else:
        side = cache_side(spec.image_size, True)
        train = Geometry(side, side if spec.fit == "crop" else 0)
    return {"train": train, "val": evaluation, "test": evaluation}
