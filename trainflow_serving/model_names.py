"""The forms of `training.model` beyond torchvision's names, told apart without importing torch
(the flow's process reads them; only the ranks and the served model build networks)."""

from __future__ import annotations

TIMM = "timm:"


def is_user_model(model_name: str) -> bool:
    """`<module>:<callable>`: a network of the user's own."""
    return ":" in model_name and not model_name.startswith(TIMM)


def network_library(model_name: str) -> str | None:
    """The package `build_network` builds `model_name` with: "torchvision" or "timm"; None for
    basicnet and a user's own module."""
    if model_name == "basicnet" or is_user_model(model_name):
        return None
    return "timm" if model_name.startswith(TIMM) else "torchvision"
