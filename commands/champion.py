"""Make a registered version the champion by hand: a rollback, or a person's choice.

    trainflow champion digits-classifier                # the champion and later versions
    trainflow champion digits-classifier 1 --reason "v2 misreads sevens in production"

Without a version it lists the champion and every later version, each with its test figures,
the gate's decision and its shadow record (predict-flow with `shadow: challenger`): how often
it agreed with the champion on production batches.

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


def describe_versions(model_name: str) -> str:
    """The champion and each later version, one line each, newest first."""
    import json

    from mlflow import MlflowClient

    from tasks.lineage import champion_version
    from tasks.register import PROMOTION, TEST_METRICS
    from tasks.shadow import SHADOW_RECORD
    from training.storage import tracking_uri

    client = MlflowClient(tracking_uri())
    champion = champion_version(client, model_name)
    since = int(champion.version) if champion is not None else 0
    found = client.search_model_versions(f"name='{model_name}'")
    lines = []
    for version in sorted(found, key=lambda v: -int(v.version)):
        if int(version.version) < since:
            continue
        tags = version.tags
        figures = json.loads(tags.get(TEST_METRICS, "{}"))
        line = (f"v{version.version}{' (champion)' * (int(version.version) == since)}: "
                f"test accuracy {figures.get('accuracy', float('nan')):.4f}, "
                f"{tags.get(PROMOTION, 'not judged')}")
        if SHADOW_RECORD in tags:
            record = json.loads(tags[SHADOW_RECORD])
            share = record["agreeing"] / record["images"] if record["images"] else 0.0
            line += (f"\n    v{version.version}: shadowed champion v{record['champion']} on "
                     f"{record['batches']} batch{'es' * (record['batches'] != 1)}, "
                     f"{record['images']} images, agreed on {record['agreeing']} "
                     f"({100 * share:.1f}%); last batch: MLflow run {record['last_run']}")
        lines.append(line)
    return "\n".join(lines) or f"no versions of {model_name!r}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow champion", description=__doc__.split("\n")[0])
    parser.add_argument("model_name")
    parser.add_argument("version", nargs="?",
                        help="the version to make champion; without it, list the versions")
    parser.add_argument("--reason", default="chosen by a person",
                        help="why; recorded on the version")
    args = parser.parse_args(argv)
    if args.version is None:
        print(describe_versions(args.model_name))
        return
    print(set_champion(args.model_name, args.version, args.reason))


if __name__ == "__main__":
    main()
