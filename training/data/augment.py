"""Training's random augmentation: torchvision's v2 transforms on one decoded uint8 image at a
time, applied where the batch is (on the GPU after the copy when there is one), each image
with its own draw."""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.config import TrainingSpec


def augmentation(spec: TrainingSpec) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """uint8 [C, H, W] -> uint8 [C, image_size, image_size] as training.augment says; None for
    "none" (the store already holds the input size)."""
    if spec.augment == "none":
        return None
    # Imported only here: torchvision's import brings torch._dynamo (about 4.5 s a rank on 2
    # cores), which a run without augmentation never needs.
    from torchvision.transforms import v2

    steps = [v2.RandomResizedCrop(spec.image_size, scale=(spec.crop_min_scale, 1.0),
                                  antialias=True)]
    if spec.augment != "crop":
        steps.append(v2.RandomHorizontalFlip())
    if spec.augment == "trivialaugment":
        steps.append(v2.TrivialAugmentWide())
    elif spec.augment == "randaugment":
        steps.append(v2.RandAugment())
    return v2.Compose(steps)
