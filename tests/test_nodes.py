"""A machine that cannot see the split, and has no remote root to fetch it from, stops before
the rendezvous and says what to set."""

from __future__ import annotations

import shutil

import pytest

from tasks.nodes import local_job
from training.handoff import TrainJob


def test_a_machine_without_the_split_names_what_it_cannot_see(digits_split, tmp_path,
                                                              monkeypatch):
    _, split = digits_split
    monkeypatch.delenv("TRAINFLOW_REMOTE_ROOT", raising=False)
    copy = tmp_path / "split"
    shutil.copytree(split.manifest.parent, copy)
    moved = split.model_copy(update={"manifest": copy / "manifest.csv"})
    job = TrainJob(split=moved, training={"num_machines": 2}, output_dir=tmp_path / "run")
    assert local_job(job, 1, "runs/x/train", None, None) == job  # a shared mount: used as it is
    (copy / "manifest.csv").unlink()
    with pytest.raises(FileNotFoundError, match=f"machine 1 .* cannot see {copy / 'manifest.csv'}"
                       ".* TRAINFLOW_REMOTE_ROOT"):
        local_job(job, 1, "runs/x/train", None, None)
