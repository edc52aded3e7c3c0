"""A machine that cannot see the shared run folder or dataset stops before the rendezvous."""

from __future__ import annotations

import shutil

import pytest

from tasks.nodes import read_job
from training.handoff import TrainJob


def test_a_machine_without_the_shared_folder_names_what_it_cannot_see(digits_split, tmp_path):
    _, split = digits_split
    with pytest.raises(FileNotFoundError, match="machine 1 .* cannot see the job file"):
        read_job(tmp_path / "elsewhere" / "job.json", machine_rank=1)

    copy = tmp_path / "split"
    shutil.copytree(split.manifest.parent, copy)
    moved = split.model_copy(update={"manifest": copy / "manifest.csv"})
    job_file = TrainJob(split=moved, training={"num_machines": 2},
                        output_dir=tmp_path / "run").save()
    assert read_job(job_file, machine_rank=1).training.num_machines == 2
    (copy / "manifest.csv").unlink()
    with pytest.raises(FileNotFoundError, match=f"cannot see {copy / 'manifest.csv'}"):
        read_job(job_file, machine_rank=1)
