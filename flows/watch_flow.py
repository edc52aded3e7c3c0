"""watch-data: tell Prefect when a train-flow deployment's folder has new labelled images.

    prefect deployment run watch-data/every-10-minutes

Cheap by design (file lists and sizes, no image is read): each train-flow deployment whose
dataset is a folder is compared with the folder as its last retrain found it, and a
`trainflow.dataset.changed` event carries the new, changed and removed images per class. A
deployment's trigger on the event (prefect.yaml) starts its retrain once
`retrain.min_new_images` is reached; its weekly schedule stays the fallback.
"""

from __future__ import annotations

from prefect import flow

from runtime.infrastructure import end_with_worker
from tasks.watch import Watched, watch_deployment, watched_deployments


@flow(name="watch-data", log_prints=True)
def watch_data(deployments: list[str] | None = None) -> list[Watched]:
    """deployments: "train-flow/<name>" to watch; every train-flow deployment when empty."""
    end_with_worker()  # runtime/infrastructure.py: a worker's flow runs end with it
    return [watch_deployment(d) for d in watched_deployments(deployments)]
