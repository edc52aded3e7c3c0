"""The served model: a preprocessed batch in, class probabilities out."""

from __future__ import annotations

import torch


class Classifier(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.model(x), dim=1)
