"""The forms of `training.model` beyond torchvision's names, told apart without importing torch
(the flow's process reads them; only the ranks and the served model build networks)."""

from __future__ import annotations

TIMM = "timm:"


def is_user_model(model_name: str) -> bool:
    """`<module>:<callable>`: a network of the user's own."""
    return ":" in model_name and not model_name.startswith(TIMM)
