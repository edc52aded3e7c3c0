"""Model construction for training: the architectures of trainflow_serving.networks, with
pretrained weights and a new head when asked."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model
from torch import nn

from trainflow_serving.networks import TIMM, build_network
from training.handoff import Preprocessing, TrainJob

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def input_channels(model_name: str, data_channels: int) -> int:
    """Torchvision models take RGB; BasicNet takes the data as it is."""
    return data_channels if model_name == "basicnet" else 3


def normalization(model_name: str, pretrained: bool, channels: int) -> tuple[list[float], list[float]]:
    """The weights' own for pretrained weights (timm's published statistics, else ImageNet's,
    as torchvision's and most weights files were trained), else 0.5 +- 0.5."""
    if pretrained and model_name.startswith(TIMM):
        import timm

        config = timm.models.get_pretrained_cfg(model_name.removeprefix(TIMM))
        if config is not None and len(config.mean) == channels:
            return list(config.mean), list(config.std)
    if pretrained:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [0.5] * channels, [0.5] * channels


def pretrained_weights_file(model_name: str) -> Path:
    """Where torchvision looks for the default weights of `model_name` in the local torch cache."""
    import torchvision

    weights = torchvision.models.get_model_weights(model_name).DEFAULT
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name


def build_model(model_name: str, num_classes: int, channels: int, image_size: int,
                pretrained: bool = False) -> nn.Module:
    if not pretrained:
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
    _replace_head(model, num_classes)
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


def _head_name(model: nn.Module) -> str:
    """The last Linear layer (resnet.fc, vgg.classifier.6, BasicNet.fc2): the classifier head."""
    name = next((n for n, m in reversed(list(model.named_modules())) if isinstance(m, nn.Linear)),
                None)
    if name is None:
        raise ValueError(f"{type(model).__name__} has no Linear head")
    return name


def head_of(model: nn.Module) -> nn.Module:
    return model.get_submodule(_head_name(model))


def _replace_head(model: nn.Module, num_classes: int) -> None:
    """Swap the head for a new one of `num_classes` outputs, as transfer learning does."""
    name = _head_name(model)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    in_features = model.get_submodule(name).in_features
    setattr(parent, name.rpartition(".")[2], nn.Linear(in_features, num_classes))


def preprocessing_for(job: TrainJob) -> Preprocessing:
    """The input the job's model expects: its size, channels and normalisation."""
    spec = job.training
    channels = input_channels(spec.model, job.split.channels)
    mean, std = normalization(spec.model, spec.pretrained or bool(spec.weights), channels)
    return Preprocessing(image_size=spec.image_size, channels=channels, mean=mean, std=std)


def model_for(job: TrainJob, pretrained: bool | None = None) -> nn.Module:
    """A new model shaped for the job's data (classes, channels, size), with the starting
    weights the spec names (`pretrained=False`: none, trained weights are loaded next)."""
    spec = job.training
    model = build_model(spec.model, len(job.split.class_names),
                        input_channels(spec.model, job.split.channels), spec.image_size,
                        spec.pretrained if pretrained is None else pretrained)
    if spec.weights and pretrained is None:
        load_starting_weights(model, Path(spec.weights), spec.model)
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


def load_starting_weights(model: nn.Module, path: Path, model_name: str) -> None:
    """`path`'s weights into `model`; a head of another class count is left new, as transfer
    learning does. Anything else that does not fit is an error naming the layers."""
    if not path.is_file():
        raise FileNotFoundError(f"training.weights {path} does not exist")
    state = {k.removeprefix("module."): v for k, v in read_state_dict(path).items()}
    own, head = model.state_dict(), _head_name(model) + "."
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
