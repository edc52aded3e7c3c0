"""What the network a fine-tune starts from sees in each image: its backbone's output, the
head taken off. The data audit's label check reads these (training/data/audit.py): an
ImageNet backbone tells flowers apart where thumbnails cannot."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

from training.config import TrainingSpec
from training.data.images import decode_image
from training.data.sides import evaluation_geometry
from training.models.build import (
    build_model,
    load_starting_weights,
    normalization,
    replaceable_head,
)

BATCH = 64


def starting_backbone(spec: TrainingSpec) -> nn.Module:
    """The network with the weights the training starts from, its head an identity."""
    model = build_model(spec.model, 2, 3, spec.image_size, spec.pretrained, spec.head)
    if spec.weights:
        load_starting_weights(model, Path(spec.weights), spec.model, spec.head)
    name = replaceable_head(model, spec.head)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    setattr(parent, name.rpartition(".")[2], nn.Identity())
    return model.eval()


def backbone_features(spec: TrainingSpec, root: Path, paths: list[str],
                      on_progress: Callable[[int, int], None] = lambda done, total: None
                      ) -> np.ndarray:
    """float32 [images, features]: each image as evaluation decodes it, through the backbone."""
    model = starting_backbone(spec)
    mean, std = normalization(spec.model, True, 3, spec.normalization)
    mean_t = torch.tensor(mean).view(1, 3, 1, 1)
    std_t = torch.tensor(std).view(1, 3, 1, 1)
    geometry = evaluation_geometry(spec)
    out = []
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool, \
            torch.inference_mode():
        for start in range(0, len(paths), BATCH):
            chunk = paths[start:start + BATCH]
            pixels = np.stack(list(pool.map(lambda rel: decode_image(root / rel, geometry)[0],
                                            chunk)))
            batch = (torch.from_numpy(pixels).float() / 255 - mean_t) / std_t
            out.append(model(batch).flatten(1).float().numpy())
            on_progress(start + len(chunk), len(paths))
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)
