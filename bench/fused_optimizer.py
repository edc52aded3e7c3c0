"""One training step (forward, backward, optimizer) per model, torch's default optimizer
kernels (`foreach`) against its fused ones (`fused=True`).

    python -m bench.fused_optimizer

Batch 64, one thread (as each rank runs here), channels_last, random data; the two kernels
alternate, three rounds each, medians. Why make_optimizer keeps torch's defaults (about 1% of
resnet18's step, within the noise: bench/RESULTS.md); bench/scale.py measures whole flows.
"""

from __future__ import annotations

import statistics
import time

import torch

from training.models.build import build_model

MODELS = [("resnet18", 64, 3), ("mobilenet_v3_small", 64, 3), ("basicnet", 28, 1)]
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def step_seconds(name: str, size: int, channels: int, optimizer: str, fused: bool
                 ) -> tuple[float, float]:
    """Seconds of one whole step, and of its optimizer.step() alone."""
    torch.manual_seed(0)
    model = build_model(name, 2, channels, size, False).to(memory_format=torch.channels_last)
    options = {"momentum": 0.9} if optimizer == "sgd" else {}
    step_with = OPTIMIZERS[optimizer](model.parameters(), lr=1e-3, fused=fused or None,
                                      **options)
    images = torch.randn(64, channels, size, size).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 2, (64,))
    whole, alone = [], []
    for i in range(7):
        started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        step_with.zero_grad()
        loss.backward()
        stepping = time.perf_counter()
        step_with.step()
        done = time.perf_counter()
        if i >= 2:  # warm-up: allocator, oneDNN primitives, the optimizer's state
            whole.append(done - started)
            alone.append(done - stepping)
    return statistics.median(whole), statistics.median(alone)


def main() -> None:
    torch.set_num_threads(1)
    print("| model | optimizer | step ms: foreach / fused | optimizer.step() ms: foreach / "
          "fused | step speed-up |\n|---|---|---|---|---|")
    for name, size, channels in MODELS:
        for optimizer in OPTIMIZERS:
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for fused in (False, True) * 3:
                runs[fused].append(step_seconds(name, size, channels, optimizer, fused))
            (step_d, opt_d), (step_f, opt_f) = (
                tuple(statistics.median(r[i] for r in runs[f]) for i in range(2))
                for f in (False, True))
            print(f"| {name} {size} px | {optimizer} | {step_d * 1e3:.1f} / {step_f * 1e3:.1f} | "
                  f"{opt_d * 1e3:.2f} / {opt_f * 1e3:.2f} | {step_d / step_f:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
