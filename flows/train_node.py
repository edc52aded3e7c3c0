"""train-node: one machine's part of a training on several machines.

Started by train-flow's train task (training.num_machines > 1), once per machine, through the
`train-node/nodes` deployment; each run goes to the work queue of its machine. Not meant to be
run by hand.
"""

from __future__ import annotations

from prefect import flow

from runtime.infrastructure import end_with_worker
from runtime.remote import RemoteSplit
from tasks.nodes import launch_node
from training.handoff import TrainJob


@flow(name="train-node")
def train_node(job: TrainJob, machine_rank: int, run_folder: str, resume: bool = True,
               machine_0_run: str | None = None, remote_split: RemoteSplit | None = None) -> int:
    """`job`: the training (paths as on the flow's machine); `run_folder`: its folder relative
    to the home; `machine_0_run`: the flow run where machines 1.. read machine 0's address;
    `remote_split`: where the split is in TRAINFLOW_REMOTE_ROOT, when no folder is shared."""
    end_with_worker()  # runtime/infrastructure.py: a worker's flow runs end with it
    return launch_node(job, machine_rank, resume, machine_0_run, run_folder, remote_split)
