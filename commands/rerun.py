"""Retrain exactly what produced a registered model version, from the parameters recorded on it.

    trainflow rerun digits-classifier 3                       # here, ephemeral Prefect
    trainflow rerun digits-classifier 3 --deployment train-flow/digits   # via a worker

The version's `trainflow.flow_parameters` tag holds the flow's four parameter models as they were
validated; the new run always trains (force=true) and goes through the gate like any other.
"""

from __future__ import annotations

import argparse
import json

from mlflow import MlflowClient

from tasks.lineage import FLOW_PARAMETERS
from training.storage import tracking_uri


def recorded_parameters(model_name: str, version: str) -> dict:
    tags = MlflowClient(tracking_uri()).get_model_version(model_name, version).tags
    if FLOW_PARAMETERS not in tags:
        raise SystemExit(f"{model_name} v{version} has no {FLOW_PARAMETERS} tag: it was not "
                         "registered by train-flow")
    return {**json.loads(tags[FLOW_PARAMETERS]), "force": True}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow rerun",
                                     description="Retrain a registered model version exactly.")
    parser.add_argument("model_name")
    parser.add_argument("version")
    parser.add_argument("--deployment", help='e.g. "train-flow/digits": run through a worker')
    args = parser.parse_args(argv)
    params = recorded_parameters(args.model_name, args.version)
    if args.deployment:
        from prefect.deployments import run_deployment

        flow_run = run_deployment(args.deployment, parameters=params, timeout=0)
        print(f"started flow run {flow_run.id} of {args.deployment}")
        return
    from flows.train_flow import train_flow

    result = train_flow(**params)
    print(result.model_dump_json(indent=2))


if __name__ == "__main__":
    main()
