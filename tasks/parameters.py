"""A run's parameters as the person who started it means them: field by field over the
deployment's.

Prefect merges a run's parameters over its deployment's one level deep: a run given
`training={"epochs": 2}` receives exactly that block, and every other training field would
fall back to the model's default instead of the deployment's value (a deployment's resnet18
at 224 px silently becomes basicnet at 28 px). The flows therefore take their parameter
blocks unvalidated (`validate_parameters=False`; the UI still renders the typed form), read
their deployment's own blocks back from the API, and lay the run's fields over them here,
before validating once. What the run names wins; everything else keeps the deployment's value.
This holds for `prefect deployment run --param`, `run_deployment(parameters=...)`, a custom
run from the UI (which sends the whole form: nothing to fill in), automations and schedules.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.runtime import deployment
from pydantic import BaseModel

from tasks import run_logger
from training.config import BLOCKS, InvalidParameters, as_fields, merge_blocks, validate_blocks


def deployment_parameters() -> dict[str, Any]:
    """The parameters stored on this flow run's deployment; {} for a run without one."""
    deployment_id = deployment.get_id()
    if not deployment_id:
        return {}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment(deployment_id).parameters or {}


def unless_invalid(task, task_run, state) -> bool:
    """Retry reading the deployment, never a parameter that will stay wrong."""
    return not isinstance(state.result(raise_on_failure=False), InvalidParameters)


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=unless_invalid)
def resolve_parameters(run: dict[str, Any]) -> dict[str, BaseModel]:
    """The parameter blocks, each over the deployment's values and validated once; bad
    values are one InvalidParameters naming every problem."""
    merged = merge_blocks(deployment_parameters(), run, tuple(BLOCKS))
    named = {name: sorted(fields) for name in BLOCKS
             if isinstance(fields := as_fields(run.get(name)), dict) and fields}
    run_logger().info("fields this run sets: %s; every other field keeps the deployment's "
                      "value or the default", json.dumps(named))
    return validate_blocks(merged)
