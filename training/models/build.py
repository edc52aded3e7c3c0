"""Model construction for training: the architectures of trainflow_serving.networks, with
pretrained weights and a new head when asked."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model
from torch import nn

from trainflow_serving.model_names import is_user_model
from trainflow_serving.networks import TIMM, build_network
from training.data.sides import evaluation_geometry
from training.handoff import Preprocessing, TrainJob

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def input_channels(model_name: str, data_channels: int) -> int:
    """Torchvision models take RGB; BasicNet takes the data as it is."""
    return data_channels if model_name == "basicnet" else 3


STATISTICS = {"imagenet": (IMAGENET_MEAN, IMAGENET_STD),
              "inception": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}
"""Input statistics by name: ImageNet's (torchvision's weights, most weights files) and the
[-1, 1] scaling of Inception, TensorFlow's EfficientNet-Lite and many timm weights."""


def normalization(model_name: str, pretrained: bool, channels: int, named: str = "auto"
                  ) -> tuple[list[float], list[float]]:
    """training.normalization: named statistics, or ("auto") the weights' own for pretrained
    weights (timm's published statistics; a user module's `pretrained_cfg`; else ImageNet's,
    as torchvision's and most weights files were trained), else 0.5 +- 0.5."""
    if named != "auto":
        mean, std = STATISTICS[named]
        return list(mean)[:channels], list(std)[:channels]
    if pretrained and model_name.startswith(TIMM):
        import timm

        config = timm.models.get_pretrained_cfg(model_name.removeprefix(TIMM))
        if config is not None and len(config.mean) == channels:
            return list(config.mean), list(config.std)
    if pretrained and (declared := declared_statistics(model_name)) is not None:
        return declared
    if pretrained:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [0.5] * channels, [0.5] * channels


def declared_statistics(model_name: str) -> tuple[list[float], list[float]] | None:
    """A user network's input statistics, declared the way timm's models carry theirs: a
    `pretrained_cfg = {"mean": (...), "std": (...)}` in the callable's module."""
    if not is_user_model(model_name):
        return None
    import importlib

    module = importlib.import_module(model_name.partition(":")[0])
    config = getattr(module, "pretrained_cfg", None)
    if not isinstance(config, dict) or not {"mean", "std"} <= config.keys():
        return None
    mean, std = [float(v) for v in config["mean"]], [float(v) for v in config["std"]]
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"{model_name}: pretrained_cfg's mean and std must be three numbers "
                         f"each, std above 0; got {config['mean']!r}, {config['std']!r}")
    return mean, std


def pretrained_weights_file(model_name: str) -> Path:
    """Where torchvision looks for the default weights of `model_name` in the local torch cache."""
    import torchvision

    weights = torchvision.models.get_model_weights(model_name).DEFAULT
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name


def build_model(model_name: str, num_classes: int, channels: int, image_size: int,
                pretrained: bool = False, head: str | None = None) -> nn.Module:
    if not pretrained or is_user_model(model_name):  # a user's callable loads its own weights
        return build_network(model_name, num_classes, channels, image_size)
    if model_name == "basicnet":
        raise ValueError("basicnet has no pretrained weights; set training.pretrained=false")
    if model_name.startswith(TIMM):
        return timm_pretrained(model_name, num_classes)
    import torchvision

    expected = pretrained_weights_file(model_name)
    if not expected.is_file():
        # No download is attempted: training machines may have no internet, and a silent
        # fallback to random weights would waste a whole training run.
        raise FileNotFoundError(
            f"pretrained weights for {model_name} are not in the torch cache: expected {expected}. "
            f"Copy the file there (or set TORCH_HOME), or set training.pretrained=false"
        )
    weights = torchvision.models.get_model_weights(model_name).DEFAULT
    model = torchvision.models.get_model(model_name, weights=weights)
    _replace_head(model, num_classes, head)
    return model


def timm_pretrained(model_name: str, num_classes: int) -> nn.Module:
    """timm's published weights, from the Hugging Face cache only: no download mid-launch."""
    import timm
    from huggingface_hub import try_to_load_from_cache

    from trainflow_serving.networks import timm_network

    timm_network(model_name, num_classes)  # the name, checked with timm's own message
    name = model_name.removeprefix(TIMM)
    config = timm.models.get_pretrained_cfg(name)
    repo = getattr(config, "hf_hub_id", None)
    cached = [path for file in ("model.safetensors", "pytorch_model.bin") if repo
              and isinstance(path := try_to_load_from_cache(repo, file), str)]
    if not cached:
        raise FileNotFoundError(
            f"pretrained weights for {model_name} are not in the Hugging Face cache "
            f"({repo or 'timm names no Hub repository for it'}); fetch them once where the "
            f"network allows (python -c \"import timm; timm.create_model('{name}', "
            'pretrained=True)"), or give a file as training.weights')
    return timm.create_model(name, pretrained=True, num_classes=num_classes,
                             pretrained_cfg_overlay={"file": cached[0]})


def head_name(model: nn.Module, named: str | None = None) -> str:
    """The classifier head's module name: `named` (training.head) when given, else timm's
    `get_classifier()`, else the last Linear layer (resnet.fc, vgg.classifier.6,
    BasicNet.fc2, a user module's last nn.Linear)."""
    modules = dict(model.named_modules())
    if named:
        if named not in modules:
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ValueError(f"training.head {named!r} is not a module of "
                             f"{type(model).__name__}; its Linear layers: "
                             f"{', '.join(linears[-4:]) or 'none'}")
        return named
    if callable(getattr(model, "get_classifier", None)):
        classifier = model.get_classifier()
        found = next((n for n, m in modules.items() if m is classifier and n), None)
        if found is not None:
            return found
    name = next((n for n, m in reversed(modules.items()) if isinstance(m, nn.Linear)), None)
    if name is None:
        raise ValueError(f"{type(model).__name__} has no Linear head; name it as training.head")
    return name


def head_of(model: nn.Module, named: str | None = None) -> nn.Module:
    return model.get_submodule(head_name(model, named))


def replaceable_head(model: nn.Module, named: str | None = None) -> str:
    """head_name, checked to be the nn.Linear a new head of other classes replaces."""
    name = head_name(model, named)
    kind = type(model.get_submodule(name)).__name__
    if not isinstance(model.get_submodule(name), nn.Linear):
        raise ValueError(f"training.head {name!r} is a {kind}, not an nn.Linear; name the "
                         "network's Linear classifier")
    return name


def _replace_head(model: nn.Module, num_classes: int, named: str | None = None) -> None:
    """Swap the head for a new one of `num_classes` outputs, as transfer learning does."""
    name = replaceable_head(model, named)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    in_features = model.get_submodule(name).in_features
    setattr(parent, name.rpartition(".")[2], nn.Linear(in_features, num_classes))


def preprocessing_for(job: TrainJob) -> Preprocessing:
    """The input the job's model expects: its size, channels and normalisation."""
    spec = job.training
    channels = input_channels(spec.model, job.split.channels)
    mean, std = normalization(spec.model, spec.starts_from_weights, channels, spec.normalization)
    geometry = evaluation_geometry(spec)
    resize = (f"bilinear, shorter side to {geometry.resize}, centre {geometry.side} crop"
              if geometry.resize else "bilinear, squashed to a square")
    return Preprocessing(image_size=spec.image_size, channels=channels, mean=mean, std=std,
                         crop_from=geometry.resize, resize=resize)


def model_for(job: TrainJob, pretrained: bool | None = None) -> nn.Module:
    """A new model shaped for the job's data (classes, channels, size), with the starting
    weights the spec names (`pretrained=False`: none, trained weights are loaded next)."""
    spec = job.training
    model = build_model(spec.model, len(job.split.class_names),
                        input_channels(spec.model, job.split.channels), spec.image_size,
                        spec.pretrained if pretrained is None else pretrained, spec.head)
    if spec.weights and pretrained is None:
        load_starting_weights(model, Path(spec.weights), spec.model, spec.head)
    return model


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors by name from safetensors, or from a torch.save'd state dict without unpickling
    anything but tensors (a bare one, or one under "state_dict")."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"weights {path} hold more than tensors, which is refused (nothing "
                         f"is unpickled): {str(e).splitlines()[0]}; save model.state_dict() "
                         "or safetensors instead") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"weights {path} are not a state dict (names to tensors)")
    return state


def load_starting_weights(model: nn.Module, path: Path, model_name: str,
                          head: str | None = None) -> None:
    """`path`'s weights into `model`; a head of another class count is left new, as transfer
    learning does. Anything else that does not fit is an error naming the layers."""
    if not path.is_file():
        raise FileNotFoundError(f"training.weights {path} does not exist")
    state = {k.removeprefix("module."): v for k, v in read_state_dict(path).items()}
    own, head = model.state_dict(), head_name(model, head) + "."
    resized = {k for k, v in state.items() if k in own and own[k].shape != v.shape}
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if k not in resized}, strict=False)
    wrong = sorted(unexpected) + sorted(k for k in resized | set(missing)
                                        if not k.startswith(head))
    if wrong:
        raise ValueError(f"weights {path} do not fit {model_name}: {', '.join(wrong[:6])}"
                         f"{' ...' if len(wrong) > 6 else ''} are not in both, or differ in "
                         "shape; give weights saved from this network")


def load_trained(job: TrainJob, weights: Path) -> nn.Module:
    """A fresh model with the saved weights, strictly matched (safetensors: nothing unpickled)."""
    model = model_for(job, pretrained=False)
    missing, unexpected = load_model(model, str(weights), strict=True)
    if missing or unexpected:
        raise RuntimeError(f"weights {weights} do not match the model: {missing=} {unexpected=}")
    return model.eval()
