"""A person's approval of a challenger that passed the gate (registry.approval=manual): the
flow run pauses with a form in the Prefect UI, and the answer is recorded on the version."""

from __future__ import annotations

import time

from mlflow import MlflowClient
from prefect import task
from prefect.input import RunInput
from pydantic import Field

from tasks import run_logger
from tasks.decision import Registration
from tasks.gate import one_decision_at_a_time
from tasks.lineage import champion_version
from tasks.register import record
from training.storage import tracking_uri


class Approval(RunInput):
    """A person's answer to a challenger that passed the gate (registry.approval=manual)."""

    approve: bool = Field(description="Make this version champion?")
    comment: str = Field("", description="Why; recorded on the version.")


# The server fails a pause whose own timeout has passed, racing our "no answer" ending; its
# timeout outlives our wait by this much, so only a flow process that died leaves it to the server.
SERVER_PAUSE_GRACE_S = 600


def ask_for_approval(registration: Registration, timeout_s: int, summary: str = "",
                     review_url: str = "") -> Approval | None:
    """Pause the flow run until a person answers in the Prefect UI (None: no answer in time).

    Called from the flow itself: only a flow run can be paused, not a task. This is Prefect's
    `pause_flow_run(wait_for_input=...)`, except that we end the wait ourselves: with one timeout
    for both, the server's pause expiry can fail the run just as we resume it to record "no answer".
    """
    from prefect.client.orchestration import get_client
    from prefect.input.actions import read_flow_run_input
    from prefect.input.run_input import keyset_from_paused_state
    from prefect.runtime import flow_run
    from prefect.states import Paused, Running

    run_logger().info("%s v%s passed the gate; waiting up to %d s for a person to approve or "
                      "reject it (Prefect UI: this flow run, Resume)", registration.model_name,
                      registration.version, timeout_s)
    run_id = flow_run.get_id()
    paused = Paused(timeout_seconds=timeout_s + SERVER_PAUSE_GRACE_S, reschedule=False,
                    pause_key=f"approve-v{registration.version}",
                    # What a notification of the pause says (commands/notify.py)
                    message=registration.description()
                    + (f" Review: {review_url}" if review_url else ""))
    keyset = keyset_from_paused_state(paused)
    paused.state_details.run_input_keyset = keyset
    with get_client(sync_client=True) as client:
        result = client.set_flow_run_state(run_id, paused)
        if not (result.state and result.state.is_paused()):
            raise RuntimeError(f"Prefect refused to pause the run for approval: {result.details}")
        # The form the UI shows, under the review's top lines and link
        described = summary or registration.description()
        if review_url:
            described += f"\n\n[The review report]({review_url})"
        Approval.with_initial_data(description=described).save(keyset)
        deadline, poll_s = time.monotonic() + timeout_s, min(10, max(1, timeout_s // 4))
        while True:
            state = client.read_flow_run(run_id).state
            if state is not None and state.is_running():
                return Approval.load(keyset)
            if time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        client.set_flow_run_state(run_id, Running(), force=True)
    late = read_flow_run_input(keyset["response"])  # an answer given as the wait ended
    return Approval(**late) if late else None


@task
def apply_approval(registration: Registration, answer: Approval | None) -> Registration:
    """Promote on a person's yes, if the champion it was compared with is still champion."""
    client = MlflowClient(tracking_uri())
    r = registration.model_copy(update={"awaiting_approval": False})
    with one_decision_at_a_time(r.model_name):
        current = champion_version(client, r.model_name)
        now = str(current.version) if current is not None else None
        if answer is None:
            r = r.model_copy(update={"reason": f"{r.reason}; no answer to the approval request "
                                     "in time, so not promoted"})
            approval = "no answer"
        elif not answer.approve:
            r = r.model_copy(update={"reason": f"{r.reason}; rejected by a person"
                                     + (f": {answer.comment}" if answer.comment else "")})
            approval = "rejected"
        elif now != r.champion_version:
            r = r.model_copy(update={"reason": f"{r.reason}; approved, but the champion became "
                                     f"v{now} while waiting, so not promoted: run again to "
                                     "compare with it"})
            approval = "approved"
        else:
            r = r.model_copy(update={"promoted": True, "reason": f"{r.reason}; approved by a "
                                     "person" + (f": {answer.comment}" if answer.comment else "")})
            approval = "approved"
        if answer is not None and answer.comment:
            client.set_model_version_tag(r.model_name, r.version, "trainflow.approval_comment",
                                         answer.comment)
        r = record(client, r, approval)
        client.set_model_version_tag(r.model_name, r.version, "trainflow.approved_at",
                                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    run_logger().info("%s", r.description())
    return r

