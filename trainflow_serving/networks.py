"""The networks' architectures, built without weights: the registered model fills them from its
safetensors file, training from its own initialisation or pretrained weights."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from trainflow_serving.model_names import TIMM, is_user_model


class UserModelError(ValueError):
    """A `<module>:<callable>` model that cannot be built; the message names the module, the
    callable and what went wrong."""


class BasicNet(nn.Module):
    """The PyTorch MNIST example network, sized from the image and class count."""

    def __init__(self, num_classes: int, channels: int = 1, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        side = (image_size - 4) // 2
        self.fc1 = nn.Linear(64 * side * side, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = self.dropout1(torch.max_pool2d(x, 2))
        x = self.dropout2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


def timm_network(model_name: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    """A model of timm's catalogue, `timm:<name>`."""
    try:
        import timm
    except ImportError:
        raise UserModelError(f'training.model {model_name!r} needs timm: pip install '
                             '"trainflow[timm]"') from None
    name = model_name.removeprefix(TIMM)
    if not timm.is_model(name):
        close = timm.list_models(f"*{name[:4]}*")[:5]
        raise UserModelError(f"training.model {model_name!r}: timm has no model {name!r}"
                             f"{'; close: ' + ', '.join(close) if close else ''}")
    return timm.create_model(name, pretrained=pretrained, num_classes=num_classes)


def user_network(model_name: str, num_classes: int) -> nn.Module:
    """The user's `<module>:<callable>` called with `num_classes=`."""
    module_name, _, attribute = model_name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserModelError(
            f"training.model {model_name!r}: cannot import module {module_name!r} ({e}); "
            "install it or put its folder on PYTHONPATH where the ranks run") from None
    factory = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise UserModelError(f"training.model {model_name!r}: module {module_name} has no "
                             f"callable {attribute!r}")
    network = factory(num_classes=num_classes)
    if not isinstance(network, nn.Module):
        raise UserModelError(
            f"training.model {model_name!r}: {module_name}.{attribute}(num_classes="
            f"{num_classes}) returned {type(network).__name__}, not a torch.nn.Module")
    return network


def build_network(model_name: str, num_classes: int, channels: int, image_size: int) -> nn.Module:
    """`model_name`'s architecture with random weights and a `num_classes` head."""
    if model_name == "basicnet":
        return BasicNet(num_classes, channels, image_size)
    if model_name.startswith(TIMM):
        return timm_network(model_name, num_classes)
    if is_user_model(model_name):
        return user_network(model_name, num_classes)
    import torchvision

    return torchvision.models.get_model(model_name, weights=None, num_classes=num_classes)


class Normalize(nn.Module):
    """uint8 batch -> normalised float batch, on whatever device the batch is on."""

    def __init__(self, mean: list[float], std: list[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1) * 255)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return (batch.float() - self.mean) / self.std
