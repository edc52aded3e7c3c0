"""What accelerators this machine has, asked without importing torch where none can exist."""

from __future__ import annotations

import glob

# The device files of a GPU driver CUDA (or ROCm, through torch.cuda) could use. Without any,
# no GPU can be visible, and the flow's process need not import torch (3 s of its fixed cost
# on 2 cores) to learn that there are none.
GPU_DEVICE_FILES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def cuda_gpu_count() -> int:
    """The GPUs CUDA sees in this process (CUDA_VISIBLE_DEVICES applies)."""
    if not gpu_driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
