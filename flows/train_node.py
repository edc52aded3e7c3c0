"""train-node: one machine's part of a training on several machines.

Started by train-flow's train task (training.num_machines > 1), once per machine, through the
`train-node/nodes` deployment; each run goes to the work queue of its machine. Not meant to be
run by hand.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.nodes import launch_node


@flow(name="train-node")
def train_node(job_file: Path, machine_rank: int, main_process_ip: str | None = None,
               main_process_port: int | None = None, resume: bool = True) -> int:
    return launch_node(job_file, machine_rank, main_process_ip, main_process_port, resume)
