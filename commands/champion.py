"""Make a registered version the champion by hand: a rollback, or a person's choice.

    trainflow champion digits-classifier 1 --reason "v2 misreads sevens in production"

The version holds `champion` until a later challenger beats it on the same test images; the
gate compares only with the current champion, so nothing moves it back on its own. Setting
the alias in the MLflow UI does the same, without the recorded reason. The change is made
under the gate's own lock, so it never lands in the middle of a run's decision.
"""

from __future__ import annotations

import argparse
import getpass
import time


def set_champion(model_name: str, version: str, reason: str) -> str:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.gate import one_decision_at_a_time
    from tasks.lineage import CHAMPION, champion_version
    from tasks.register import PROMOTION, PROMOTION_REASON
    from training.storage import redacted, tracking_uri

    client = MlflowClient(tracking_uri())
    try:
        client.get_model_version(model_name, version)
    except MlflowException:
        raise SystemExit(f"no version {version} of registered model {model_name!r} in "
                         f"{redacted(tracking_uri())}; list them in the MLflow UI (Models)") from None
    with one_decision_at_a_time(model_name):
        before = champion_version(client, model_name)
        client.set_registered_model_alias(model_name, CHAMPION, version)
    by = getpass.getuser()
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())
    was = f" (was v{before.version})" if before is not None else ""
    for key, value in {PROMOTION: "set by hand", PROMOTION_REASON: reason,
                       "trainflow.set_by": by, "trainflow.set_at": when}.items():
        client.set_model_version_tag(model_name, version, key, value)
    old = client.get_model_version(model_name, version).description or ""
    client.update_model_version(model_name, version, description=(
        f"v{version} made champion by hand by {by} at {when}{was}: {reason}.\n\n{old}").strip())
    return f"{model_name} v{version} is champion{was}: {reason}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow champion", description=__doc__.split("\n")[0])
    parser.add_argument("model_name")
    parser.add_argument("version")
    parser.add_argument("--reason", default="chosen by a person",
                        help="why; recorded on the version")
    args = parser.parse_args(argv)
    print(set_champion(args.model_name, args.version, args.reason))


if __name__ == "__main__":
    main()
