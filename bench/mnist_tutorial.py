"""The seed tutorial's script, for bench/mnist.py: torchvision's MNIST class, BasicNet (the
PyTorch MNIST example's network), AdamW 1e-3, one epoch, data-parallel under Accelerate.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \
        -m bench.mnist_tutorial --root ROOT

Prints one JSON line: the seconds to load the dataset, to the first step and of the epoch,
and the accuracy on the 10,000 test digits.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from trainflow_serving.networks import BasicNet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    started = time.perf_counter()
    accelerator = Accelerator()
    torch.manual_seed(0)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    train = datasets.MNIST(args.root, train=True, download=False, transform=transform)
    test = datasets.MNIST(args.root, train=False, download=False, transform=transform)
    loaded = time.perf_counter() - started
    model = BasicNet(10, 1, 28)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test, batch_size=256)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader)
    first_step = None
    epoch_started = time.perf_counter()
    model.train()
    for images, labels in train_loader:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if first_step is None:
            first_step = time.perf_counter() - started
    epoch = time.perf_counter() - epoch_started
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in test_loader:
            predicted = accelerator.gather_for_metrics((model(images).argmax(1), labels))
            correct += int((predicted[0] == predicted[1]).sum())
            total += len(predicted[1])
    if accelerator.is_main_process:
        print(json.dumps({"load_seconds": loaded, "first_step_seconds": first_step,
                          "epoch_seconds": epoch, "test_accuracy": correct / total,
                          "test_images": total, "world_size": accelerator.num_processes}),
              flush=True)


if __name__ == "__main__":
    main()
