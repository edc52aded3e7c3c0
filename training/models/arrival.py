"""What a network says of itself before anything is downloaded: whether it arrives with trained
weights, the input size it declares, and the sizes its forward pass can take.

A user's `<module>:<callable>` usually loads its own weights (`EfficientNet.from_pretrained`,
`timm.create_model(..., pretrained=True)`, a `load_state_dict` in the callable) and says
nothing about it. The preflight asks the network: built twice under two seeds, a freshly
initialised network differs, a loaded one does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainflow_serving.model_names import is_user_model
from training.config import TrainingSpec

if TYPE_CHECKING:  # torch is imported where a network is built: basicnet's check needs none
    from torch import nn

PROBE_CLASSES = 2
"""The class count the preflight builds with, before the data says how many there are."""
LARGEST_PROBE = 1024
"""TrainingSpec.image_size's upper bound: no size above it is tried."""


@dataclass(frozen=True)
class Arrival:
    """How a network arrives: `identical` of `compared` initialised parameter values came out
    the same under two seeds."""

    identical: int
    compared: int

    @property
    def pretrained(self) -> bool:
        # The new head (and any layer the callable adds) is random in both builds; a loaded
        # backbone is most of the network.
        return self.compared > 0 and self.identical * 2 >= self.compared

    def why(self, model_name: str) -> str:
        share = self.identical / self.compared if self.compared else 0.0
        if self.pretrained:
            return (f"{model_name} arrives pretrained: built under two seeds, {share:.0%} of its "
                    "initialised weights came out identical, so its callable loads weights; "
                    "fine-tuning defaults apply (set training.pretrained=false to train it as "
                    "from scratch)")
        return (f"{model_name} arrives untrained: built under two seeds, {share:.0%} of its "
                "initialised weights came out identical; from-scratch defaults apply (set "
                "training.pretrained=true if its callable loads weights)")


def seeded_build(model_name: str, seed: int, image_size: int = 32) -> nn.Module:
    """The network as `build_network` makes it, with torch's generator at `seed` and restored
    afterwards."""
    import torch

    from trainflow_serving.networks import build_network

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_network(model_name, PROBE_CLASSES, 3, image_size)


def how_it_arrives(model_name: str, first: nn.Module | None = None) -> Arrival:
    """Whether `model_name`'s callable returns loaded weights: two builds compared parameter by
    parameter. Parameters that start constant (BatchNorm's scale 1 and shift 0, biases at 0)
    are the same either way and say nothing, so they are not compared."""
    import torch

    first = seeded_build(model_name, 0) if first is None else first
    second = seeded_build(model_name, 1)
    identical = compared = 0
    seconds = dict(second.named_parameters())
    for name, value in first.named_parameters():
        other = seconds.get(name)
        if other is None or other.shape != value.shape or value.numel() < 2:
            continue
        if bool((value == value.flatten()[0]).all()):
            continue
        compared += value.numel()
        if torch.equal(value, other):
            identical += value.numel()
    return Arrival(identical, compared)


def declared_input_size(network: nn.Module, model_name: str) -> int | None:
    """The side a network declares, as timm's models do: `pretrained_cfg["input_size"]`
    (channels, height, width) on the network or in the callable's module."""
    import importlib

    configs = [getattr(network, "pretrained_cfg", None)]
    if is_user_model(model_name):
        configs.append(getattr(importlib.import_module(model_name.partition(":")[0]),
                               "pretrained_cfg", None))
    for config in configs:
        size = config.get("input_size") if isinstance(config, dict) else None
        if isinstance(size, list | tuple) and len(size) == 3 and int(size[1]) == int(size[2]):
            return int(size[2])
    return None


def forward_error(network: nn.Module, channels: int, size: int) -> str | None:
    """Why one image of `size` x `size` cannot pass through the network, or None."""
    import torch

    network.eval()
    device = next(network.parameters(), torch.empty(0)).device
    try:
        with torch.no_grad():
            network(torch.zeros(1, channels, size, size, device=device))
    except Exception as e:  # any failure of the user's forward is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def smallest_size(network: nn.Module, channels: int, works: int) -> int:
    """The smallest side the forward pass takes, given one that works (sizes above the smallest
    working one are assumed to work, as pooling networks do)."""
    low, high = 1, works  # low fails or is untried-at-1, high works
    if forward_error(network, channels, 1) is None:
        return 1
    while high - low > 1:
        middle = (low + high) // 2
        if forward_error(network, channels, middle) is None:
            high = middle
        else:
            low = middle
    return high


def size_problem(network: nn.Module, model_name: str, channels: int, size: int) -> str | None:
    """One line naming a training.image_size the network cannot take and the smallest it can,
    or None when `size` passes."""
    error = forward_error(network, channels, size)
    if error is None:
        return None
    works = next((s for s in (224, 512, LARGEST_PROBE) if s > size
                  and forward_error(network, channels, s) is None), None)
    if works is None:
        return (f"{model_name} cannot take a {size} px image ({error}), nor any up to "
                f"{LARGEST_PROBE} px: check its forward pass with a [1, {channels}, 224, 224] "
                "batch")
    least = smallest_size(network, channels, works)
    return (f"training.image_size {size} is too small for {model_name}: its forward pass "
            f"fails at {size} px ({error}); the smallest size it takes is {least} px: set "
            f"training.image_size to at least {least} (224 for ImageNet weights)")


@dataclass(frozen=True)
class Resolved:
    """The spec as the network made it, and what the network said (for the run's log)."""

    training: TrainingSpec
    notes: list[str]
    network: nn.Module | None = None
    """The network built for the checks (untrained head of PROBE_CLASSES), if one was."""


def as_it_arrives(training: TrainingSpec) -> Resolved:
    """`training` with what its network says of itself, fields given explicitly kept: a user
    network that loads its own weights is a fine-tune (`pretrained` true, and every default
    that follows it), and its declared input size is the default image size. Raises ValueError
    for an image size the network's forward pass cannot take."""
    if training.model == "basicnet":  # sized from the image itself
        return Resolved(training, [])
    import torch

    from trainflow_serving.networks import build_network

    if not is_user_model(training.model):
        # A library network's shapes are checked on the meta device: no weights are made
        # (vgg16: 1.5 s and 0.5 GB less) and no arithmetic is done.
        with torch.device("meta"):
            network = build_network(training.model, PROBE_CLASSES, 3, 32)
    else:
        network = seeded_build(training.model, 0)
    given, notes = training.model_dump(exclude_unset=True), []
    if is_user_model(training.model):
        if "pretrained" in given:
            said = "pretrained" if training.pretrained else "untrained"
            notes.append(f"{training.model} is {said}, as training.pretrained says")
        elif not training.weights:
            arrival = how_it_arrives(training.model, network)
            notes.append(arrival.why(training.model))
            given["pretrained"] = arrival.pretrained
        if (given.get("pretrained") or training.weights) and "image_size" not in given:
            declared = declared_input_size(network, training.model)
            if declared is not None:
                given["image_size"] = declared
                notes.append(f"image_size {declared}, as {training.model} declares "
                             "(pretrained_cfg input_size)")
    resolved = TrainingSpec.model_validate(given) if notes else training
    problem = size_problem(network, training.model, 3, resolved.image_size)
    if problem is not None:
        raise ValueError(problem)
    return Resolved(resolved, notes, network)
