"""End to end as users run it: `make services` code, `prefect deploy`, `prefect deployment run`.

A real Prefect server, MLflow server and process worker on 127.0.0.1 and free ports; the
flow runs in the worker's subprocess; the test reads the results through both APIs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from mlflow import MlflowClient

from commands import services, work_pool
from tasks.lineage import FLOW_RUN_ID, GIT_COMMIT, GIT_DIRTY, metric_tag
from tasks.register import PROMOTION
from training.engine.progress import ProgressReader
from training.processes import alive, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[1]
PREFECT = str(services.BIN / "prefect")
SMALL = {"epochs": 1, "image_size": 12, "batch_size": 50, "num_processes": 2}


@dataclass
class Stack:
    env: dict
    home: Path
    folder: Path  # pid files and logs
    start: Callable[[], dict]  # starts what is not running (a restart after a kill)

    @property
    def api(self) -> str:
        return self.env["PREFECT_API_URL"]

    @property
    def mlflow(self) -> MlflowClient:
        return MlflowClient(self.env["MLFLOW_TRACKING_URI"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stack")
    home = folder / "home"
    extra = {"TRAINFLOW_HOME": str(home), "PREFECT_HOME": str(folder / "prefect"),
             "PWD": str(REPO),  # prefect.yaml's pull step is "{{ $PWD }}" at deploy time
             # The notification test's receiver is plain HTTP on 127.0.0.1, which MLflow's
             # webhooks refuse by default (https only, no private addresses). The second
             # switch is MLflow's internal _MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS: test-only.
             "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
             "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
             # The server reads its webhook list again after this long (60 s by default), so
             # a webhook made mid-module is seen by the next alias set.
             "MLFLOW_WEBHOOK_CACHE_TTL": "1"}
    ports = free_port(), free_port()

    def start() -> dict:
        return services.start(folder / "services", *ports, pool="e2e-pool", extra_env=extra)

    try:
        env = start()
        done = subprocess.run([PREFECT, "--no-prompt", "deploy", "--name", "digits", "--pool",
                               "e2e-pool"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        yield Stack(env, home, folder / "services", start)
    finally:
        services.stop(folder / "services")


def run_deployment(stack: Stack, params: dict, env: dict | None = None,
                   deployment: str = "train-flow/digits") -> str:
    command = [PREFECT, "deployment", "run", deployment, "--params", json.dumps(params)]
    if env:
        command += ["--job-variable", f"env={json.dumps(env)}"]
    done = subprocess.run(command, env=stack.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout).group(1)


def prefect_client(stack: Stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Client:
        def __enter__(self):
            self._settings = temporary_settings({PREFECT_API_URL: stack.api})
            self._settings.__enter__()
            self._client = get_client(sync_client=True)
            return self._client.__enter__()

        def __exit__(self, *exc):
            self._client.__exit__(*exc)
            self._settings.__exit__(*exc)

    return _Client()


def wait_final(stack: Stack, flow_run_id: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    with prefect_client(stack) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(2)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout} s")


def mlflow_run_of(stack: Stack, flow_run_id: str):
    runs = stack.mlflow.search_runs(
        [e.experiment_id for e in stack.mlflow.search_experiments()],
        filter_string=f"tags.`{FLOW_RUN_ID}` = '{flow_run_id}'")
    assert len(runs) == 1
    return runs[0]


def test_deployment_run_trains_registers_and_triggers_scoring_with_the_champion(stack):
    """A deployment run trains, evaluates and registers its champion through the worker, and
    predict-flow/digits-champion's trigger (prefect.yaml) then scores the digits with it.
    The gate's "not promoted" through the server is the scenario test's third run."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    done = subprocess.run([PREFECT, "--no-prompt", "deploy", "--name", "digits-champion",
                           "--pool", "e2e-pool"], cwd=REPO, env=stack.env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    started = time.monotonic()
    first = run_deployment(stack, {"training": SMALL})
    run = wait_final(stack, first)
    assert run.state.is_completed(), run.state.message
    print(f"e2e: one deployment run in {time.monotonic() - started:.0f} s")
    with prefect_client(stack) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        names = {t.name.rsplit("-", 1)[0] for t in tasks}
        assert {"check_before_start", "prepare_dataset", "split_dataset", "train",
                "evaluate_model", "register_model"} <= names
        assert all(t.state.is_completed() for t in tasks)
        tracked = mlflow_run_of(stack, first)
        assert tracked.info.status == "FINISHED"
        assert tracked.data.params["world_size"] == "2"
        assert tracked.data.metrics["test_accuracy"] > 0.5
        champion = stack.mlflow.get_model_version_by_alias("digits-classifier", "champion")
        assert champion.tags[FLOW_RUN_ID] == first

        deployment = client.read_deployment_by_name("predict-flow/digits-champion")
        only_it = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        deadline, runs = time.monotonic() + 120, []
        while not runs and time.monotonic() < deadline:
            runs = client.read_flow_runs(deployment_filter=only_it)
            time.sleep(1)
        assert runs, "no predict-flow run was triggered"
        assert wait_final(stack, str(runs[0].id)).state.is_completed()
        # Later tests' digits runs would each trigger another scoring: CI time, nothing checked.
        client.delete_deployment(deployment.id)
    experiment = stack.mlflow.get_experiment_by_name("predict-flow")
    scored = stack.mlflow.search_runs([experiment.experiment_id])
    assert scored[0].data.metrics["images"] == 1797 and scored[0].data.metrics["errors"] == 0
    assert scored[0].data.tags["trainflow.model_version"] == champion.version


def test_cancelling_a_flow_run_stops_every_rank(stack):
    flow_run_id = run_deployment(
        stack, {"training": {**SMALL, "epochs": 50, "heartbeat_steps": 1},
                "registry": {"model_name": "cancel-test"}},
        env={"TRAINFLOW_FAULT": "slow:step=0.2"})
    progress = stack.home / "runs" / flow_run_id / "train"
    deadline, pids = time.monotonic() + 300, []
    while time.monotonic() < deadline and len(pids) < 2:
        if (progress / "progress").exists():
            pids = [e.pid for e in ProgressReader(progress).poll() if e.event == "start"]
        time.sleep(0.5)
    assert len(pids) == 2, "training never started"
    cancelled_at = time.monotonic()
    subprocess.run([PREFECT, "flow-run", "cancel", flow_run_id], env=stack.env, check=True,
                   capture_output=True, timeout=60)
    while any(alive(p) for p in pids) and time.monotonic() - cancelled_at < 60:
        time.sleep(0.1)
    # How soon is a figure for bench/, not an assertion here (the machine may be slow).
    assert not any(alive(p) for p in pids), "ranks outlived the cancellation"
    run = wait_final(stack, flow_run_id, timeout=120)
    assert run.state.is_cancelled() or run.state.is_failed()
    deadline = time.monotonic() + 30
    while mlflow_run_of(stack, flow_run_id).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(1)
    assert mlflow_run_of(stack, flow_run_id).info.status in ("KILLED", "FAILED")


def test_two_flow_runs_at_once_register_both_and_keep_the_better(stack):
    registry = {"model_name": "concurrent-digits"}
    good = run_deployment(stack, {"training": {**SMALL, "lr": 1e-4}, "registry": registry})
    better = run_deployment(stack, {"training": {**SMALL, "epochs": 3, "lr": 2e-3},
                                    "registry": registry})
    # prefect.yaml's limit for the deployment and the services' limit for the pool: two at once
    with prefect_client(stack) as client:
        assert client.read_deployment_by_name(
            "train-flow/digits").global_concurrency_limit.limit == 2
        assert client.read_work_pool("e2e-pool").concurrency_limit == services.POOL_LIMIT == 2
    assert wait_final(stack, good).state.is_completed()
    assert wait_final(stack, better).state.is_completed()
    versions = stack.mlflow.search_model_versions("name='concurrent-digits'")
    assert sorted(v.tags[FLOW_RUN_ID] for v in versions) == sorted([good, better])
    best = max(versions, key=lambda v: float(v.tags[metric_tag("accuracy")]))
    champion = stack.mlflow.get_model_version_by_alias("concurrent-digits", "champion")
    assert champion.version == best.version


def test_three_first_runs_on_a_fresh_home_all_complete_and_register(stack, tmp_path):
    """A deploy or a schedule boundary on a new worker: three runs of one model start at the
    same moment with an empty home, a new MLflow experiment and a new model name (its gate's
    concurrency limit made on first use). All complete: three versions, one copy of the data."""
    deploy(stack, "fresh-home", {"dataset": {"source": "builtin:digits"}, "training": SMALL,
                                 "registry": {"model_name": "fresh-home"}})
    fresh = {"TRAINFLOW_HOME": str(tmp_path / "home"), "TRAINFLOW_EXPERIMENT": "fresh-home"}
    pool_limit = [PREFECT, "work-pool", "set-concurrency-limit", "e2e-pool"]
    subprocess.run([*pool_limit, "3"], env=stack.env, check=True, capture_output=True)
    try:
        runs = [run_deployment(stack, {}, env=fresh, deployment="train-flow/fresh-home")
                for _ in range(3)]
        finals = [wait_final(stack, run) for run in runs]
    finally:
        subprocess.run([*pool_limit, str(services.POOL_LIMIT)], env=stack.env, check=True,
                       capture_output=True)
    assert [run.state.type.value for run in finals] == ["COMPLETED"] * 3, [
        run.state.message for run in finals]
    # At once: there was a moment when all three were running (the last began before the
    # first ended), however slowly a busy machine started them.
    assert max(run.start_time for run in finals) < min(run.end_time for run in finals), [
        (run.start_time, run.end_time) for run in finals]
    versions = stack.mlflow.search_model_versions("name='fresh-home'")
    assert sorted(v.tags[FLOW_RUN_ID] for v in versions) == sorted(runs)
    [experiment] = [e for e in stack.mlflow.search_experiments() if e.name == "fresh-home"]
    assert len(stack.mlflow.search_runs([experiment.experiment_id])) == 3
    copies = [p.name for p in (tmp_path / "home" / "datasets" / "builtin").iterdir()
              if not p.name.endswith(".lock")]
    assert copies == ["digits"]


def test_a_flow_started_by_hand_uses_the_running_server(stack, tmp_path):
    """The fast path: with `make services` up and PREFECT_API_URL set, `trainflow train`
    starts no temporary server, and its run is in the server's UI."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    params = {"dataset": {"source": "builtin:digits"}, "training": SMALL,
              "registry": {"model_name": "by-hand"}}
    (tmp_path / "run.json").write_text(json.dumps(params))
    done = subprocess.run([str(services.BIN / "trainflow"), "train", "--config",
                           str(tmp_path / "run.json"), "--json"],
                          cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "temporary server" not in output.lower()
    assert "Traceback" not in output
    printed = done.stdout[done.stdout.index("{\n"):done.stdout.rindex("}") + 1]
    mlflow_run_id = json.loads(printed)["mlflow_run_id"]
    with prefect_client(stack) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["train-flow"])))
    by_hand = [r for r in runs if r.deployment_id is None and r.state.is_completed()]
    assert by_hand, "the run is not on the running server"
    tags = stack.mlflow.get_run(mlflow_run_id).data.tags
    assert tags[FLOW_RUN_ID] in {str(r.id) for r in by_hand}


def deploy(stack: Stack, name: str, params: dict) -> None:
    done = subprocess.run([PREFECT, "--no-prompt", "deploy", "flows/train_flow.py:train_flow",
                           "--name", name, "--pool", "e2e-pool", "--params", json.dumps(params)],
                          cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def run_with_param(stack: Stack, deployment: str, *params: str) -> str:
    command = [PREFECT, "deployment", "run", deployment]
    for param in params:
        command += ["--param", param]
    done = subprocess.run(command, env=stack.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout).group(1)


def git(*args, cwd: Path | None = None) -> str:
    done = subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@localhost",
                           *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_worker_runs_the_code_it_clones_from_git_not_a_checkout(stack, tmp_path):
    """deploy/git/prefect.yaml: the worker (whose folder holds no checkout) clones the branch
    named at deploy time and runs that commit, which this checkout does not have."""
    origin, work = tmp_path / "origin.git", tmp_path / "work"
    git("clone", "--quiet", "--bare", REPO, origin)
    git("clone", "--quiet", origin, work)
    git("checkout", "--quiet", "-b", "worker-test", cwd=work)
    (work / "CLONED.md").write_text("a commit only the repository has\n")
    git("add", "CLONED.md", cwd=work)
    git("commit", "--quiet", "-m", "a commit the worker must run", cwd=work)
    git("push", "--quiet", "origin", "worker-test", cwd=work)
    commit = git("rev-parse", "HEAD", cwd=work)
    env = {**stack.env, "TRAINFLOW_GIT_REPOSITORY": origin.as_uri(),
           "TRAINFLOW_GIT_BRANCH": "worker-test"}
    done = subprocess.run([PREFECT, "--no-prompt", "deploy", "--prefect-file",
                           "deploy/git/prefect.yaml", "--name", "digits-from-git", "--pool",
                           "e2e-pool"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    flow_run_id = run_with_param(stack, "train-flow/digits-from-git",
                                 f"training={json.dumps(SMALL)}",
                                 'registry={"model_name": "digits-from-git"}')
    run = wait_final(stack, flow_run_id)
    assert run.state.is_completed(), run.state.message
    tags = mlflow_run_of(stack, flow_run_id).data.tags
    assert tags[GIT_COMMIT] == commit and tags[GIT_DIRTY] == "false"
    assert commit != git("rev-parse", "HEAD", cwd=REPO)


def test_a_private_repository_is_cloned_with_a_token_that_appears_nowhere(stack, tmp_path):
    """deploy/git/prefect.yaml with the documented credentials: the token lives in a Prefect
    Secret block, the repository is served over HTTPS with Basic auth, and after the run the
    token is in no parameter, job variable, deployment, log, MLflow record or file."""
    from prefect.blocks.system import Secret
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    from tests.servers import git_https_server

    token = "ghp_PLANTEDgitTOKEN42"
    served = tmp_path / "served"
    served.mkdir()
    git("clone", "--quiet", "--bare", REPO, served / "trainflow.git")
    with prefect_client(stack):
        Secret(value=token).save("trainflow-git-token", overwrite=True)
    recipe = (REPO / "deploy/git/prefect.yaml").read_text()
    credentials = ('          branch: "{{ $TRAINFLOW_GIT_BRANCH }}"\n'
                   "          credentials:\n            username: trainflow\n"
                   '            access_token: "{{ prefect.blocks.secret.trainflow-git-token }}"\n')
    assert '          branch: "{{ $TRAINFLOW_GIT_BRANCH }}"\n' in recipe
    private = tmp_path / "prefect.yaml"
    private.write_text(recipe.replace('          branch: "{{ $TRAINFLOW_GIT_BRANCH }}"\n',
                                      credentials))
    with git_https_server(served, token) as (url, cert):
        env = {**stack.env, "TRAINFLOW_GIT_REPOSITORY": f"{url}/trainflow.git",
               "TRAINFLOW_GIT_BRANCH": git("rev-parse", "--abbrev-ref", "HEAD", cwd=REPO)}
        done = subprocess.run([PREFECT, "--no-prompt", "deploy", "--prefect-file", str(private),
                               "--name", "digits-from-git", "--pool", "e2e-pool"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        flow_run_id = run_deployment(
            stack, {"training": SMALL, "registry": {"model_name": "private-git"}},
            env={"GIT_SSL_CAINFO": str(cert), "GIT_TERMINAL_PROMPT": "0"},
            deployment="train-flow/digits-from-git")
        run = wait_final(stack, flow_run_id)
    assert run.state.is_completed(), run.state.message
    mlflow_run = mlflow_run_of(stack, flow_run_id)
    assert mlflow_run.data.tags[GIT_COMMIT] == git("rev-parse", "HEAD", cwd=REPO)

    with prefect_client(stack) as client:
        deployment = client.read_deployment_by_name("train-flow/digits-from-git")
        flow_run = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[flow_run_id])))[0]
        logs = client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    assert logs
    prefect_side = [str(deployment.pull_steps), str(deployment.job_variables),
                    str(flow_run.parameters), str(flow_run.job_variables),
                    *(log.message for log in logs)]
    assert "prefect.blocks.secret.trainflow-git-token" in str(deployment.pull_steps)
    assert not [text for text in prefect_side if token in text]
    client = stack.mlflow
    version = client.search_model_versions("name='private-git'")[0]
    recorded = [str(mlflow_run.data.params), str(mlflow_run.data.tags), str(version.tags)]
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    recorded += [str(model.tags), str(model.params)]
    assert not [text for text in recorded if token in text]
    artifacts = Path(client.download_artifacts(mlflow_run.info.run_id, "", str(tmp_path / "a")))
    leaked = [p for root in (artifacts, stack.home, stack.folder) for p in root.rglob("*")
              if p.is_file() and token.encode() in p.read_bytes()]
    assert leaked == []


def wait_paused(stack: Stack, flow_run_id: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    with prefect_client(stack) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and (state.is_paused() or state.is_final()):
                return state
            time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} never paused")


def test_manual_approval_is_asked_and_the_answer_holds(stack):
    """registry.approval=manual: approved -> champion; rejected or unanswered -> not, and the
    version says which and why."""
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.register import APPROVAL

    runs = {answer: run_deployment(stack, {"training": SMALL, "registry": {
        "model_name": f"approval-{answer}", "approval": "manual",
        "approval_timeout_s": 20 if answer == "none" else 600}})
        for answer in ("yes", "no", "none")}
    answers = {"yes": {"approve": True, "comment": "checked the confusion matrix"},
               "no": {"approve": False, "comment": "sevens look wrong"}}
    from prefect.input.run_input import read_flow_run_input

    with temporary_settings({PREFECT_API_URL: stack.api}):
        for answer, reply in answers.items():
            state = wait_paused(stack, runs[answer])
            assert state.is_paused()
            # The form shows the review's top lines and its link above the question.
            form = read_flow_run_input(state.state_details.run_input_keyset["description"],
                                       flow_run_id=runs[answer])
            assert form.startswith("**v1: test_accuracy") and "challenger v1: accuracy" in form
            assert "review/review.html" in form
            resume_flow_run(runs[answer], run_input=reply)
    for answer, flow_run_id in runs.items():
        run = wait_final(stack, flow_run_id)
        assert run.state.is_completed(), (answer, run.state.message)
    yes = stack.mlflow.get_registered_model("approval-yes")
    assert "champion" in yes.aliases
    approved = stack.mlflow.get_model_version("approval-yes", yes.aliases["champion"])
    assert approved.tags[APPROVAL] == "approved"
    assert "approved by a person: checked the confusion matrix" in approved.description
    for answer, said in (("no", "rejected by a person: sevens look wrong"),
                         ("none", "no answer to the approval request in time")):
        model = stack.mlflow.get_registered_model(f"approval-{answer}")
        assert "champion" not in model.aliases
        [version] = stack.mlflow.search_model_versions(f"name='approval-{answer}'")
        assert version.tags[PROMOTION] == "not promoted" and said in version.description


def test_retraining_scenario_grown_data_partial_override_rollback(stack, tmp_path):
    """Through the server and worker: v1; the data grows and a run changes one field (the
    deployment's other fields hold), so v2 is judged against v1 on v2's own test images; a
    person rolls back to v1; a weaker v3, started with the typed CLI, then faces v1 and is not
    promoted."""
    import shutil

    from tasks.register import COMPARED_IMAGES, COMPARED_WITH
    from training.data.sources import write_digits

    digits = write_digits(tmp_path / "digits")
    data = tmp_path / "data"
    for label in range(10):
        files = sorted((digits / str(label)).glob("*.png"))
        (data / str(label)).mkdir(parents=True)
        for f in files[: len(files) // 2]:
            shutil.copy(f, data / str(label) / f.name)
    deploy(stack, "scenario", {
        "dataset": {"source": str(data)},
        "training": {**SMALL, "epochs": 1, "lr": 0.002, "lr_schedule": "cosine",
                     "batch_size": 40},
        "registry": {"model_name": "scenario-digits"}})
    name, mlflow = "scenario-digits", stack.mlflow

    v1_run = run_with_param(stack, "train-flow/scenario")
    assert wait_final(stack, v1_run).state.is_completed()
    for label in range(10):  # the data grows: the other half of every class
        for f in sorted((digits / str(label)).glob("*.png")):
            shutil.copy(f, data / str(label) / f.name)
    v2_run = run_with_param(stack, "train-flow/scenario", 'training={"epochs": 4}')
    assert wait_final(stack, v2_run).state.is_completed()
    params = mlflow_run_of(stack, v2_run).data.params  # `--param training=` set epochs alone
    assert {k: params[k] for k in ("epochs", "lr_schedule", "lr", "batch_size", "image_size")} == {
        "epochs": "4", "lr_schedule": "cosine", "lr": "0.002", "batch_size": "40", "image_size": "12"}
    [v2] = [v for v in mlflow.search_model_versions(f"name='{name}'")
            if v.tags[FLOW_RUN_ID] == v2_run]
    v2_tests = int(float(mlflow_run_of(stack, v2_run).data.metrics["test_images"]))
    v1_tests = int(float(mlflow_run_of(stack, v1_run).data.metrics["test_images"]))
    assert v2_tests > v1_tests
    assert v2.tags[COMPARED_WITH] == "1" and int(v2.tags[COMPARED_IMAGES]) == v2_tests
    assert f"on the same {v2_tests} test images" in v2.description
    assert mlflow.get_model_version_by_alias(name, "champion").version == v2.version, (
        v2.description)
    recorded = json.loads(v2.tags["trainflow.flow_parameters"])["training"]
    assert (recorded["epochs"], recorded["batch_size"], recorded["lr_schedule"]) == (4, 40, "cosine")

    rollback = subprocess.run([str(services.BIN / "trainflow"), "champion", name, "1",
                               "--reason", "rollback drill"], env=stack.env,
                              capture_output=True, text=True, timeout=120)
    assert rollback.returncode == 0, rollback.stderr[-2000:]
    done = subprocess.run([str(services.BIN / "trainflow"), "run", "train-flow/scenario",
                           "--training.lr", "1e-6", "--watch"], env=stack.env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert 'fields set: {"training": {"lr": 1e-06}}' in done.stdout, done.stdout[-2000:]
    v3_run = re.search(r"\(([0-9a-f-]{36})\)", done.stdout).group(1)
    params = mlflow_run_of(stack, v3_run).data.params
    assert {k: params[k] for k in ("lr", "epochs", "lr_schedule", "batch_size")} == {
        "lr": "1e-06", "epochs": "1", "lr_schedule": "cosine", "batch_size": "40"}
    [v3] = [v for v in mlflow.search_model_versions(f"name='{name}'")
            if v.tags[FLOW_RUN_ID] == v3_run]
    assert v3.tags[COMPARED_WITH] == "1" and "not promoted" in v3.description
    assert v3.tags[PROMOTION] == "not promoted"
    assert mlflow.get_model_version_by_alias(name, "champion").version == "1"
    assert mlflow.get_model_version_by_alias(name, "challenger").version == v3.version


def test_a_new_kaggle_version_reaches_the_next_deployment_run(stack, tmp_path):
    """What the weekly schedule's runs see, through the worker: nothing new -> skipped (no new
    version); a new version on Kaggle -> downloaded and trained."""
    from tests.imagegen import dogs_vs_cats_zip
    from tests.kaggle_standin import KaggleStandIn

    slug, name = "dogs-vs-cats-redux-kernels-edition", "weekly-cats"
    deploy(stack, "weekly", {
        "dataset": {"source": f"kaggle:competitions/{slug}", "labels": "filename",
                    "subdir": "train"},
        "split": {"test_fraction": 0.3},
        # Enough learning that v1 clearly beats chance and becomes champion.
        "training": {**SMALL, "epochs": 3, "lr": 0.003, "image_size": 16, "batch_size": 16},
        "registry": {"model_name": name}})
    # The stand-in's test credentials reach the worker's flow run as its environment.
    kaggle_env = {"KAGGLE_API_ENVIRONMENT": "TEST", "KAGGLE_USERNAME": "tester",
                  "KAGGLE_KEY": "KGL-TEST-ONLY"}
    job = f"env={json.dumps(kaggle_env)}"

    def weekly_run() -> str:
        done = subprocess.run([PREFECT, "deployment", "run", "train-flow/weekly",
                               "--job-variable", job], env=stack.env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout).group(1)
        assert wait_final(stack, flow_run_id).state.is_completed()
        return flow_run_id

    with KaggleStandIn("tester", "KGL-TEST-ONLY") as kaggle:
        kaggle.archives[f"competitions/{slug}"] = dogs_vs_cats_zip({"cat": 30, "dog": 30})
        weekly_run()
        weekly_run()  # the same version on Kaggle: skipped
        assert len(stack.mlflow.search_model_versions(f"name='{name}'")) == 1
        assert kaggle.downloads == 1
        kaggle.archives[f"competitions/{slug}"] = dogs_vs_cats_zip({"cat": 40, "dog": 40})
        third = weekly_run()
    assert kaggle.downloads == 2
    versions = stack.mlflow.search_model_versions(f"name='{name}'")
    assert len(versions) == 2
    [new] = [v for v in versions if v.tags[FLOW_RUN_ID] == third]
    assert new.tags["trainflow.compared_with_version"] == "1"


def slow_training(stack: Stack, model_name: str, epochs: int) -> tuple[str, list[int]]:
    """A deployment run whose epochs take ~2.5 s, and its ranks' pids once one has ended."""
    flow_run_id = run_deployment(
        stack, {"training": {**SMALL, "epochs": epochs, "heartbeat_steps": 1},
                "registry": {"model_name": model_name}},
        env={"TRAINFLOW_FAULT": "slow:step=0.15"})
    return flow_run_id, rank_pids_once_training(stack, flow_run_id)


def rank_pids_once_training(stack: Stack, flow_run_id: str, timeout: float = 300) -> list[int]:
    """The ranks' pids, once rank 0 has finished an epoch."""
    progress = stack.home / "runs" / flow_run_id / "train"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (progress / "progress").exists():
            events = ProgressReader(progress).poll()
            if any(e.event == "epoch" for e in events):
                return [e.pid for e in events if e.event == "start"]
        time.sleep(0.5)
    raise AssertionError("training never finished an epoch")


def kill_service(stack: Stack, name: str, sig: int = signal.SIGKILL) -> int:
    pid = int((stack.folder / f"{name}.pid").read_text())
    os.killpg(pid, sig)  # the service and the processes it started in its group
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
    return pid


def test_the_prefect_server_restarted_during_training_does_not_stop_the_run(stack):
    """The API is gone while the ranks train four more epochs: they go on, the clients retry,
    the run completes and registers once, and the restarted server shows it."""
    flow_run_id, ranks = slow_training(stack, "prefect-restart", epochs=14)
    reader = ProgressReader(stack.home / "runs" / flow_run_id / "train")

    def last_epoch(seen: int) -> int:
        return max([seen] + [e.epoch for e in reader.poll() if e.event == "epoch"])

    before = last_epoch(0)
    kill_service(stack, "prefect-server")
    deadline, now = time.monotonic() + 120, before
    while now < before + 4 and time.monotonic() < deadline:
        now = last_epoch(now)
        time.sleep(0.5)
    assert now >= before + 4, "the ranks stopped with the API"
    assert all(alive(p) for p in ranks), "the ranks died with the API"
    stack.start()
    run = wait_final(stack, flow_run_id)
    assert run.state.is_completed(), run.state.message
    assert not any(alive(p) for p in ranks)
    versions = stack.mlflow.search_model_versions("name='prefect-restart'")
    assert [v.tags[FLOW_RUN_ID] for v in versions] == [flow_run_id]


def states_of(stack: Stack, flow_run_id: str) -> list:
    with prefect_client(stack) as client:
        return client.read_flow_run_states(flow_run_id)


def wait_state(stack: Stack, flow_run_id: str, kind: str, timeout: float) -> object:
    """The first state of type `kind` (e.g. "CRASHED") in the run's history."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := [s for s in states_of(stack, flow_run_id) if s.type.value == kind]:
            return found[0]
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} never {kind}: "
                         f"{[s.name for s in states_of(stack, flow_run_id)]}")


def assert_finished_once(stack: Stack, model_name: str, flow_run_id: str) -> None:
    """The retried run completed, as one MLflow run and one version of `model_name`."""
    run = wait_final(stack, flow_run_id)
    assert run.state.is_completed(), run.state.message
    assert run.run_count == 2
    versions = stack.mlflow.search_model_versions(f"name='{model_name}'")
    assert [v.tags[FLOW_RUN_ID] for v in versions] == [flow_run_id]
    assert mlflow_run_of(stack, flow_run_id).info.status == "FINISHED"


class Receiver:
    """A team's webhook endpoint on 127.0.0.1: every JSON POST it gets, in order."""

    def __init__(self):
        import http.server
        import threading

        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path, json.loads(body or b"{}")))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def wait_for(self, what: Callable[[dict], bool], timeout: float = 120) -> list[dict]:
        """The messages matching `what`, once there is one (a second copy is caught by
        `count` at the end, after later messages went through the same path)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [body for _, body in list(self.received) if what(body)]
            if found:
                return found
            time.sleep(0.5)
        raise AssertionError(f"no such message in {self.received}")

    def count(self, what: Callable[[dict], bool]) -> int:
        return sum(1 for _, body in list(self.received) if what(body))


DRIFT_EVENT = """
from prefect.events import emit_event
from tasks.drift import EVENT
emit_event(EVENT, resource={"prefect.resource.id": "trainflow.model.notify-drift",
                            "trainflow.model": "notify-drift", "trainflow.model_version": "3"},
           payload={"drifted": ["brightness", "confidence"], "batch_images": 179,
                    "mlflow_run_id": "0123abcd"})
"""


def test_a_team_hears_of_an_approval_wait_a_failure_an_alias_move_and_drift(stack):
    """`trainflow notify --webhook URL`: one message for a failed run, one for a run waiting
    for approval (its version, the gate's sentence, the review, the run's link), one for a
    champion moved by hand, one for a drift event; the URL's secret path is in none of them,
    nor printed."""
    from commands import notify

    receiver = Receiver()
    secret = "T0SECRET/B0SECRET/not-a-real-token"
    url = f"http://127.0.0.1:{receiver.port}/hooks/{secret}"
    trainflow = str(services.BIN / "trainflow")
    try:
        done = subprocess.run([trainflow, "notify", "--webhook", url], env=stack.env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert secret not in done.stdout + done.stderr
        failed = run_deployment(stack, {"dataset": {"source": "/no/such/folder"},
                                        "registry": {"model_name": "notify-failed"}})
        assert wait_final(stack, failed).state.is_failed()
        [failure] = receiver.wait_for(lambda m: failed in m.get("text", ""))
        assert "Failed" in failure["text"] and "/no/such/folder" in failure["text"]

        paused = run_deployment(stack, {"training": SMALL, "registry": {
            "model_name": "notify-approval", "approval": "manual", "approval_timeout_s": 600}})
        assert wait_paused(stack, paused).is_paused()
        [waiting] = receiver.wait_for(lambda m: paused in m.get("text", ""))
        text = waiting["text"]
        assert "waits for approval" in text and "v1: test_accuracy" in text
        assert "passed the gate, waiting for approval" in text
        assert re.search(r"Review: http\S+/artifacts/review/review\.html", text)
        from prefect.flow_runs import resume_flow_run
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: stack.api}):
            resume_flow_run(paused, run_input={"approve": True, "comment": "fine"})
        assert wait_final(stack, paused).state.is_completed()

        def champion(m):  # MLflow's envelope: entity, action, timestamp, data
            data = m.get("data") or {}
            return (m.get("entity") == "model_version_alias" and data.get("alias") == "champion"
                    and data.get("name") == "notify-approval")

        assert len(receiver.wait_for(champion)) == 1  # set by the approval
        done = subprocess.run([trainflow, "champion", "notify-approval", "1", "--reason",
                               "by hand"], env=stack.env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        deadline = time.monotonic() + 60
        while len([m for _, m in receiver.received if champion(m)]) < 2 and (
                time.monotonic() < deadline):
            time.sleep(0.5)
        moves = [m for _, m in receiver.received if champion(m)]
        assert len(moves) == 2 and moves[-1]["data"]["version"] == "1"

        # As predict-flow sends it, from a process of its own: this one's events worker may
        # be bound to another test's server already (Prefect keeps one per process).
        emit = subprocess.run([str(services.BIN / "python"), "-c", DRIFT_EVENT], env=stack.env,
                              capture_output=True, text=True, timeout=120)
        assert emit.returncode == 0, emit.stderr[-2000:]
        [drift] = receiver.wait_for(lambda m: "notify-drift" in m.get("text", ""))
        assert "notify-drift v3: a scored batch drifted" in drift["text"]
        assert "Drifted: brightness, confidence (179 images)" in drift["text"]
        assert "0123abcd" in drift["text"]
        # Each message once: the later ones came through the same automations and webhooks,
        # so a second copy of an earlier one would be here by now.
        assert receiver.count(lambda m: failed in m.get("text", "")) == 1
        assert receiver.count(lambda m: paused in m.get("text", "")) == 1
        assert receiver.count(champion) == 2
        assert all(secret not in json.dumps(body) for _, body in receiver.received)
        assert all(path == f"/hooks/{secret}" for path, _ in receiver.received)
    finally:
        receiver.server.shutdown()
        with prefect_client(stack) as client:
            for name in (notify.APPROVAL, notify.FAILURE, notify.DRIFT):
                for automation in client.read_automations_by_name(name):
                    client.delete_automation(automation.id)
        for hook in stack.mlflow.list_webhooks():
            stack.mlflow.delete_webhook(hook.webhook_id)


def test_work_pools_are_made_with_the_heartbeat_and_the_lost_run_automations(stack):
    """`trainflow work-pool create` for a Kubernetes pool, as README says, and the services'
    process pool: each run's environment beats every HEARTBEAT_S, and the automations exist
    once however often a pool is made."""
    done = subprocess.run([str(services.BIN / "trainflow"), "work-pool", "create", "k8s-e2e",
                           "--type", "kubernetes", "--base-job-template",
                           str(REPO / "deploy" / "kubernetes" / "base-job-template.json")],
                          env=stack.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with prefect_client(stack) as client:
        for name in ("k8s-e2e", "e2e-pool"):
            template = client.read_work_pool(name).base_job_template
            env = template["variables"]["properties"]["env"]["default"]
            assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(work_pool.HEARTBEAT_S)
        for name in (work_pool.LOST_RUNS, work_pool.RETRY_LOST):
            assert len(client.read_automations_by_name(name)) == 1
        client.delete_work_pool("k8s-e2e")


def test_a_killed_worker_crashes_its_run_and_a_new_worker_finishes_it(stack):
    """The worker is SIGKILLed: its flow run (tied to it) is told at once and Crashed, its
    ranks are gone, and the lost-run automation schedules the run again for the next worker,
    which resumes it to one version."""
    flow_run_id, ranks = slow_training(stack, "worker-kill", epochs=12)
    kill_service(stack, "worker")
    deadline = time.monotonic() + 60
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in ranks), "ranks outlived their worker"
    # Told by its SIGTERM, the run reports its own crash at once; were that report lost, its
    # heartbeats stop and the automation crashes it within the window all the same.
    wait_state(stack, flow_run_id, "CRASHED", timeout=work_pool.LOST_AFTER_S + 60)
    stack.start()  # a new worker
    assert_finished_once(stack, "worker-kill", flow_run_id)


@pytest.mark.extended  # the window it waits out is minutes; CI keeps the killed-worker case
def test_a_lost_machine_is_crashed_by_its_heartbeats_and_retried_to_completion(stack):
    """The whole process tree of a flow run (worker, flow run, launcher, ranks) is frozen and
    SIGKILLed: no Python is left to report. The heartbeat automation marks the run Crashed
    within the window, the retry automation schedules it again, and a new worker resumes it."""
    def automations() -> list:
        with prefect_client(stack) as client:
            return [a.id for name in (work_pool.LOST_RUNS, work_pool.RETRY_LOST)
                    for a in client.read_automations_by_name(name)]

    installed = automations()  # created with the work pool, one of each
    assert len(installed) == 2
    flow_run_id, _ = slow_training(stack, "lost-machine", epochs=12)
    worker = psutil.Process(int((stack.folder / "worker.pid").read_text()))
    tree = [worker, *worker.children(recursive=True)]
    assert len(tree) >= 4, [p.cmdline() for p in tree]  # worker, flow run, launcher, ranks
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: none reacts to another's end
        for process in tree:
            process.send_signal(sig)
    killed_at = time.time()
    psutil.wait_procs(tree, timeout=30)
    assert not any(alive(p.pid) for p in tree)
    stack.start()  # another machine's worker
    assert automations() == installed  # kept: they remember the heartbeats already seen
    crashed = wait_state(stack, flow_run_id, "CRASHED",
                         timeout=work_pool.LOST_AFTER_S + work_pool.HEARTBEAT_S + 60)
    assert "No heartbeat" in crashed.message
    # Prefect's proactive triggers are evaluated every few seconds past the window.
    assert crashed.timestamp.timestamp() - killed_at < (
        work_pool.LOST_AFTER_S + work_pool.HEARTBEAT_S + 30)
    assert_finished_once(stack, "lost-machine", flow_run_id)


def dataset_events(stack: Stack, deployment: str, count: int, timeout: float = 60
                   ) -> list[dict]:
    """The deployment's trainflow.dataset.changed events, once `count` of them are stored
    (the server stores events in batches, a few seconds after they arrive)."""
    from tasks.watch import DEPLOYMENT_LABEL, EVENT

    deadline = time.monotonic() + timeout
    while True:
        found = httpx.post(f"{stack.api}/events/filter", json={"filter": {
            "event": {"name": [EVENT]},
            "resource": {"labels": {DEPLOYMENT_LABEL: [deployment]}}}, "limit": 50},
            timeout=30)
        found.raise_for_status()
        events = sorted(found.json()["events"], key=lambda e: e["occurred"])
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(1)


def runs_of(stack: Stack, deployment: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with prefect_client(stack) as client:
        found = client.read_deployment_by_name(deployment)
        return client.read_flow_runs(deployment_filter=DeploymentFilter(
            id=DeploymentFilterId(any_=[found.id])))


def test_new_labelled_images_start_a_retrain_through_the_deployments_trigger(stack, tmp_path):
    """watch-data (deployed, run by the worker) finds 30 new images in a folder: one
    trainflow.dataset.changed event with the counts per class, and train-flow/watched's
    trigger (as prefect.yaml writes it) starts exactly one run, on the grown folder. Then 5 more,
    below the deployment's retrain.min_new_images of 20: an event, no run; 20 more reach it
    (25 since the last retrain): the second run, and only it."""
    import shutil

    from tasks.watch import DEPLOYMENT_LABEL, EVENT, RETRAIN_LABEL
    from training.data.sources import write_digits

    digits = write_digits(tmp_path / "digits")
    data = tmp_path / "photos"
    files = {label: sorted((digits / label).glob("*.png")) for label in ("0", "1", "2")}

    def add(label: str, count: int) -> None:
        (data / label).mkdir(parents=True, exist_ok=True)
        have = len(list((data / label).iterdir()))
        for f in files[label][have:have + count]:
            shutil.copy(f, data / label / f.name)

    for label in files:
        add(label, 40)
    # The trigger as prefect.yaml gives train-flow/photos, for this deployment.
    recipe = yaml.safe_load((REPO / "prefect.yaml").read_text())
    [trigger] = [t for d in recipe["deployments"] if d["name"] == "photos"
                 for t in d["triggers"] if t["expect"] == [EVENT]]
    assert trigger["match"] == {DEPLOYMENT_LABEL: "train-flow/photos", RETRAIN_LABEL: "due"}
    trigger["match"][DEPLOYMENT_LABEL] = "train-flow/watched"
    done = subprocess.run([PREFECT, "--no-prompt", "deploy", "flows/train_flow.py:train_flow",
                           "--name", "watched", "--pool", "e2e-pool", "--trigger",
                           json.dumps(trigger), "--params", json.dumps({
                               "dataset": {"source": str(data)}, "training": SMALL,
                               "registry": {"model_name": "watched-digits"},
                               "retrain": {"min_new_images": 20}})],
                          cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([PREFECT, "--no-prompt", "deploy", "flows/watch_flow.py:watch_data",
                           "--name", "watch-e2e", "--pool", "e2e-pool", "--params",
                           json.dumps({"deployments": ["train-flow/watched"]})],
                          cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def watch() -> None:
        run = wait_final(stack, run_with_param(stack, "watch-data/watch-e2e"))
        assert run.state.is_completed(), run.state.message

    def retrain(expected: int) -> object:
        deadline, runs = time.monotonic() + 120, []
        while len(runs) < expected and time.monotonic() < deadline:
            runs = runs_of(stack, "train-flow/watched")
            time.sleep(1)
        assert len(runs) == expected, runs
        newest = max(runs, key=lambda r: r.created)
        assert wait_final(stack, str(newest.id)).state.is_completed()
        inputs = mlflow_run_of(stack, str(newest.id)).inputs.dataset_inputs
        return sum(json.loads(i.dataset.profile)["num_rows"] for i in inputs)

    watch()  # the baseline: nothing to say yet
    for label in files:
        add(label, 10)
    watch()
    [event] = dataset_events(stack, "train-flow/watched", 1)
    assert event["resource"][RETRAIN_LABEL] == "due"
    assert event["payload"]["new"] == {"0": 10, "1": 10, "2": 10}
    assert event["payload"]["changed"] == {} and event["payload"]["removed"] == {}
    assert event["payload"]["images"] == 150
    assert retrain(1) == 150  # the run trained on the grown folder

    add("0", 5)
    watch()
    events = dataset_events(stack, "train-flow/watched", 2)
    assert len(events) == 2 and events[-1]["resource"][RETRAIN_LABEL] == "not-due"
    assert events[-1]["payload"]["new"] == {"0": 5}
    add("1", 20)
    watch()
    events = dataset_events(stack, "train-flow/watched", 3)
    assert len(events) == 3 and events[-1]["resource"][RETRAIN_LABEL] == "due"
    assert events[-1]["payload"]["new"] == {"0": 5, "1": 20}
    assert retrain(2) == 175  # the not-due event, processed before this one, started nothing
