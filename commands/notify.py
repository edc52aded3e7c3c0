"""trainflow notify: a team hears when a run waits for a person, fails or crashes, when what a
champion scores drifts, and when a model version gets an alias (the champion moving, after the
gate or a hand rollback).

    trainflow notify --webhook https://hooks.slack.com/services/T0/B0/XXXX   # Slack, or any
                                                                             # JSON receiver
    trainflow notify --block slack-webhook/ml-team   # an existing Prefect notification block

Through the tools' own mechanisms, on the servers of PREFECT_API_URL and MLFLOW_TRACKING_URI:
- two Prefect automations send a notification block's message for train-flow and sweep-flow
  runs: "waits for approval" (its state message carries the version, the gate's sentence and the
  review's link) and "failed" / "crashed" (with the error); each with the run's link;
- a third, for predict-flow's `trainflow.scoring.drift` event: the model, its version, the
  tests that drifted and the batch's MLflow run;
- an MLflow webhook (its server, a SQL store) posts every alias set on a model version.
With --webhook, the URL is saved as a Prefect `CustomWebhookNotificationBlock` (a secret field,
JSON body `{"text": ...}`, which Slack's incoming webhooks take) and as MLflow's webhook; it is
never printed or logged. Running it again replaces what it made.
"""

from __future__ import annotations

import argparse
import os
import sys

from commands import work_pool

WEBHOOK_BLOCK = "trainflow-notify"
FLOWS = ["train-flow", "sweep-flow"]
APPROVAL = "trainflow: a run waits for approval"
FAILURE = "trainflow: a run failed or crashed"
DRIFT = "trainflow: a scored batch drifted"
MLFLOW_WEBHOOK = "trainflow-aliases"
LINK = "{{ flow_run|ui_url }}"


def _webhook_block(url: str) -> str:
    """The webhook as a Prefect notification block; its document id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name="trainflow", url=url, method="POST",
        json_data={"text": "{{subject}}\n{{body}}"})
    return str(block.save(WEBHOOK_BLOCK, overwrite=True))


def _block_id(slug: str) -> str:
    """The document id of the notification block `type/name` (e.g. slack-webhook/ml-team)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    kind, _, name = slug.partition("/")
    if not name:
        sys.exit(f"trainflow notify: --block {slug!r} needs the block's type and name, "
                 "e.g. slack-webhook/ml-team (the Prefect UI's Blocks page lists them)")
    with get_client(sync_client=True) as client:
        try:
            return str(client.read_block_document_by_name(name, kind).id)
        except ObjectNotFound:
            sys.exit(f"trainflow notify: no block {slug!r} on this Prefect server; create it "
                     "in the UI (Blocks) or use --webhook URL")


def automations(block_id: str):
    from prefect.automations import Automation
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    from tasks.drift import EVENT as DRIFT_EVENT

    ours = {"prefect.resource.role": "flow", "prefect.resource.name": FLOWS}
    runs = {"prefect.resource.id": "prefect.flow-run.*"}

    def trigger(*states: str) -> EventTrigger:
        return EventTrigger(expect={f"prefect.flow-run.{s}" for s in states}, match=runs,
                            match_related=ours, posture=Posture.Reactive, threshold=1)

    return [
        Automation(name=APPROVAL, trigger=trigger("Paused"), actions=[SendNotification(
            block_document_id=block_id,
            subject="{{ flow.name }} run {{ flow_run.name }} waits for approval",
            body="{{ flow_run.state.message }}\nApprove or reject it: " + LINK)]),
        Automation(name=FAILURE, trigger=trigger("Failed", "Crashed"), actions=[SendNotification(
            block_document_id=block_id,
            subject="{{ flow.name }} run {{ flow_run.name }}: {{ flow_run.state.name }}",
            body="{{ flow_run.state.message }}\nThe run: " + LINK)]),
        Automation(name=DRIFT, trigger=EventTrigger(
            expect={DRIFT_EVENT}, match={"prefect.resource.id": "trainflow.model.*"},
            posture=Posture.Reactive, threshold=1), actions=[SendNotification(
                block_document_id=block_id,
                subject="{{ event.resource['trainflow.model'] }} "
                        "v{{ event.resource['trainflow.model_version'] }}: a scored batch "
                        "drifted from its test split",
                body="Drifted: {{ event.payload.drifted|join(', ') }} "
                     "({{ event.payload.batch_images }} images). The batch's MLflow run: "
                     "{{ event.payload.mlflow_run_id }}")]),
    ]


def mlflow_webhook(url: str) -> None:
    from mlflow import MlflowClient
    from mlflow.entities.webhook import WebhookAction, WebhookEntity, WebhookEvent

    client = MlflowClient()
    for old in client.list_webhooks():
        if old.name == MLFLOW_WEBHOOK:
            client.delete_webhook(old.webhook_id)
    client.create_webhook(
        name=MLFLOW_WEBHOOK, url=url,
        events=[WebhookEvent(WebhookEntity.MODEL_VERSION_ALIAS, WebhookAction.CREATED)],
        description="trainflow notify: an alias set on a model version (champion, challenger)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow notify", description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--webhook", help="a URL that takes a JSON POST (Slack, Teams, a bot)")
    where.add_argument("--block", help="a Prefect notification block as TYPE/NAME, e.g. "
                       "slack-webhook/ml-team or email/ml-team")
    args = parser.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        sys.exit("trainflow notify: PREFECT_API_URL is not set; export the server's URL "
                 "(e.g. http://127.0.0.1:4200/api) and run it again")
    block_id = _webhook_block(args.webhook) if args.webhook else _block_id(args.block)
    work_pool.install_automations(automations(block_id))
    said = [f"Prefect automations {APPROVAL!r}, {FAILURE!r} and {DRIFT!r}"]
    if args.webhook and os.environ.get("MLFLOW_TRACKING_URI", "").startswith("http"):
        mlflow_webhook(args.webhook)
        said.append(f"the MLflow webhook {MLFLOW_WEBHOOK!r} (aliases set)")
    print("notifications on: " + "; ".join(said))
