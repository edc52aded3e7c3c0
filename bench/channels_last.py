"""One training step (forward, backward, Adam) per model, contiguous against channels_last.

    python -m bench.channels_last

Batch 64, one thread, random data; the layouts alternate, two rounds each, medians. Chose
TrainingSpec.channels_last's default; bench/step_options.py measures whole launches.
"""

from __future__ import annotations

import statistics
import time

import torch

from training.models.build import build_model

MODELS = [("basicnet", 28, 1), ("basicnet", 8, 1), ("resnet18", 64, 3),
          ("mobilenet_v3_small", 64, 3), ("vgg16", 64, 3)]


def step_seconds(name: str, size: int, channels: int, channels_last: bool) -> float:
    torch.manual_seed(0)
    model = build_model(name, 2, channels, size, False)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters())
    images, labels = torch.randn(64, channels, size, size), torch.randint(0, 2, (64,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(2):  # warm-up: allocator, oneDNN primitives
        step()
    steps = 2 if name == "vgg16" else 5
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps


def main() -> None:
    torch.set_num_threads(1)
    print("| model | contiguous ms | channels_last ms | speed-up |\n|---|---|---|---|")
    for name, size, channels in MODELS:
        times: dict[bool, list[float]] = {False: [], True: []}
        for layout in (False, True) * 2:
            times[layout].append(step_seconds(name, size, channels, layout))
        plain, last = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} {size} px | {plain * 1e3:.1f} | {last * 1e3:.1f} | {plain / last:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
