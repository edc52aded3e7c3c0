"""Run under `accelerate launch`: what each rank's sampler and random draws are after the
training's own setup (make_loaders, then prepare_then_seed_per_rank), written to OUT/rank<N>.json.

    accelerate launch --multi_gpu --num_processes 2 -m tests.probes.rank_seeds JOB OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed

from training.engine.progress import start_rank
from training.handoff import TrainJob
from training.train import make_accelerator, make_loaders, prepare_then_seed_per_rank


def main() -> None:
    job, out = TrainJob.load(Path(sys.argv[1])), Path(sys.argv[2])
    accelerator = make_accelerator(job)
    rank, progress = start_rank(accelerator, job.output_dir)
    set_seed(job.training.seed)  # as train() begins
    train_loader, _ = make_loaders(job, accelerator, progress)
    train_loader = prepare_then_seed_per_rank(accelerator, rank, job.training, train_loader)
    indices = [i for batch in train_loader.batch_sampler for i in batch]
    draws = torch.rand(4).tolist()
    (out / f"rank{rank.index}.json").write_text(json.dumps({"indices": indices, "draws": draws}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
