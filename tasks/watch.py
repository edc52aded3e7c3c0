"""watch_deployment: what changed in a train-flow deployment's folder since its last retrain,
told to Prefect as a `trainflow.dataset.changed` event.

The baseline is the folder as it was when watch-data last called a retrain due; below the
deployment's `retrain.min_new_images`, the counts keep adding up from it, so 5 new images a
day reach a threshold of 20 on the fourth day. An event is emitted only when the folder
differs from the previous watch, so a scheduled watch of a quiet folder says nothing. The
deployment's trigger (prefect.yaml) starts the run on the events labelled due.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import task
from prefect.events import emit_event
from pydantic import BaseModel

from tasks import run_logger
from training.config import DatasetSpec, RetrainSpec
from training.data.watch import Changes, compare, listing, watchable
from training.storage import file_lock, home, write_json_atomic

EVENT = "trainflow.dataset.changed"
DEPLOYMENT_LABEL = "trainflow.deployment"
RETRAIN_LABEL = "trainflow.retrain"
"""due when the new or changed images reach the deployment's retrain.min_new_images"""


class Watched(BaseModel):
    deployment: str
    """flow/deployment"""
    source: str
    changes: Changes | None = None
    """None on the first watch (the baseline) and for a source that is not a folder"""
    due: bool = False
    event_id: str | None = None
    note: str = ""


class WatchedDeployment(BaseModel):
    id: str
    name: str
    """flow/deployment"""
    dataset: DatasetSpec
    retrain: RetrainSpec


def _digest(found: dict) -> str:
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()


@task
def watched_deployments(names: list[str] | None = None) -> list[WatchedDeployment]:
    """The train-flow deployments to watch: `names` ("train-flow/<name>"), or all of them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        if names:
            found = [client.read_deployment_by_name(name) for name in names]
        else:
            found = client.read_deployments(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["train-flow"])))
        flows = {d.flow_id: client.read_flow(d.flow_id).name for d in found}
    watched = []
    for deployment in found:
        parameters = deployment.parameters or {}
        if "dataset" not in parameters:  # its runs name their data: nothing to watch
            continue
        watched.append(WatchedDeployment(
            id=str(deployment.id), name=f"{flows[deployment.flow_id]}/{deployment.name}",
            dataset=DatasetSpec.model_validate(parameters["dataset"]),
            retrain=RetrainSpec.model_validate(parameters.get("retrain") or {})))
    return watched


@task
def watch_deployment(deployment: WatchedDeployment) -> Watched:
    """Compare the deployment's folder with its baseline; emit an event when it changed."""
    logger = run_logger()
    spec = deployment.dataset
    if not watchable(spec):
        return Watched(deployment=deployment.name, source=spec.source,
                       note=f"a {spec.kind} source: its run checks its version itself")
    folder = Path(spec.source).expanduser()
    if not folder.is_dir():  # not made yet: nothing to watch, and nothing wrong with the watch
        logger.warning("%s: its dataset folder %s does not exist (yet)", deployment.name,
                       folder.resolve())
        return Watched(deployment=deployment.name, source=spec.source,
                       note=f"no folder {folder.resolve()}")
    state_file = home() / "watch" / f"{deployment.id}.json"
    state_file.parent.mkdir(parents=True, exist_ok=True)
    identity = spec.model_dump(mode="json")
    with file_lock(state_file.with_suffix(".lock")):  # one watch of a deployment at a time
        now = listing(spec)
        state = json.loads(state_file.read_text()) if state_file.is_file() else None
        if state is None or state["dataset"] != identity:
            write_json_atomic(state_file, {"dataset": identity, "baseline": now,
                                           "seen": _digest(now)}, compact=True)
            logger.info("%s: baseline of %d images recorded for %s", deployment.name, len(now),
                        spec.source)
            return Watched(deployment=deployment.name, source=spec.source,
                           note=f"baseline of {len(now)} images")
        if state["seen"] == _digest(now):
            return Watched(deployment=deployment.name, source=spec.source, note="unchanged")
        changes = compare({k: tuple(v) for k, v in state["baseline"].items()}, now)
        due = changes.new_or_changed >= deployment.retrain.min_new_images
        event = emit_event(
            event=EVENT,
            resource={"prefect.resource.id": f"trainflow.dataset.{deployment.id}",
                      "prefect.resource.name": spec.source,
                      DEPLOYMENT_LABEL: deployment.name,
                      RETRAIN_LABEL: "due" if due else "not-due"},
            related=[{"prefect.resource.id": f"prefect.deployment.{deployment.id}",
                      "prefect.resource.role": "deployment",
                      "prefect.resource.name": deployment.name.split("/", 1)[1]}],
            payload={**changes.model_dump(), "new_or_changed": changes.new_or_changed,
                     "min_new_images": deployment.retrain.min_new_images})
        # Below the threshold the baseline stays, so the next images add to these.
        baseline = now if due else state["baseline"]
        write_json_atomic(state_file, {"dataset": identity, "baseline": baseline,
                                       "seen": _digest(now)}, compact=True)
    logger.info("%s: %d new, %d changed, %d removed images (%d to start a retrain): %s",
                deployment.name, sum(changes.new.values()), sum(changes.changed.values()),
                sum(changes.removed.values()), deployment.retrain.min_new_images,
                "retrain due" if due else "not yet")
    return Watched(deployment=deployment.name, source=spec.source, changes=changes, due=due,
                   event_id=str(event.id) if event else None)
