"""The production stack, as README's Production section runs it: `trainflow services start
--stack production` (PostgreSQL, an S3 server, Prefect on PostgreSQL, MLflow with basic-auth
proxying artifacts to a bucket, a worker), then `prefect deploy` and `prefect deployment run`.

Every server is real and started by the command under test; the module stops them all.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from commands import production_stack, services
from training.processes import alive, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[1]
PREFECT = str(services.BIN / "prefect")
TRAINFLOW = str(services.BIN / "trainflow")
MODEL = "digits-classifier"
SMALL = {"epochs": 1, "image_size": 12, "num_processes": 2}


class Stack:
    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder, self.env = folder, env
        self.client_env = production_stack.client_env(folder)
        self.keys = production_stack.StackSecrets.load_or_create(folder)

    @property
    def user_env(self) -> dict[str, str]:
        """A person's shell after `. client.env`: the two URLs and MLflow's user and password."""
        return {**self.env, **self.client_env}

    def mlflow(self) -> MlflowClient:
        return MlflowClient(self.client_env["MLFLOW_TRACKING_URI"])

    def pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in self.folder.glob("*.pid")}

    def start(self) -> subprocess.CompletedProcess:
        ports = json.loads((self.folder / "ports.json").read_text())
        return trainflow("services", "start", "--stack", "production", "--folder", self.folder,
                         *[a for name, port in ports.items()
                           for a in (f"--{name}-port", str(port))], env=self.env)


def trainflow(*args, env: dict, timeout: float = 300, cwd: Path = REPO):
    return subprocess.run([TRAINFLOW, *map(str, args)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def prefect(*args, env: dict, timeout: float = 600):
    done = subprocess.run([PREFECT, "--no-prompt", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("production")
    folder = root / "services"
    env = {**os.environ, "TRAINFLOW_HOME": str(root / "home"),
           "PREFECT_HOME": str(root / "prefect"), "PWD": str(REPO)}
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD"):
        env.pop(name, None)
    ports = [free_port() for _ in range(4)]
    try:
        done = trainflow("services", "start", "--stack", "production", "--folder", folder,
                         "--postgres-port", ports[0], "--s3-port", ports[1], "--prefect-port",
                         ports[2], "--mlflow-port", ports[3], env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        stack = Stack(folder, env)
        assert stack.keys.mlflow_password not in done.stdout + done.stderr
        # This process's MLflow clients read the user and password from the environment.
        os.environ["MLFLOW_TRACKING_USERNAME"] = stack.client_env["MLFLOW_TRACKING_USERNAME"]
        os.environ["MLFLOW_TRACKING_PASSWORD"] = stack.client_env["MLFLOW_TRACKING_PASSWORD"]
        yield stack
    finally:
        os.environ.pop("MLFLOW_TRACKING_USERNAME", None)
        os.environ.pop("MLFLOW_TRACKING_PASSWORD", None)
        services.stop(folder)


def test_a_deployment_runs_through_the_worker_and_its_model_lands_in_the_bucket(stack):
    prefect("deploy", "--name", "digits", "--name", "digits-champion", env=stack.user_env)
    out = prefect("deployment", "run", "train-flow/digits", "--param",
                  f"training={json.dumps(SMALL)}", "--watch", env=stack.user_env)
    assert "Completed" in out

    champion = stack.mlflow().get_model_version_by_alias(MODEL, "champion")
    location = stack.mlflow().get_model_version_download_uri(MODEL, champion.version)
    assert location.startswith("mlflow-artifacts:/")  # proxied by the server, not a local path
    s3 = production_stack.s3_client(stack.folder)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=production_stack.BUCKET)["Contents"]]
    model_id = champion.source.removeprefix("models:/")
    model_files = {k.rsplit(f"{model_id}/artifacts/", 1)[1] for k in keys if model_id in k}
    assert {"MLmodel", "artifacts/best.safetensors", "requirements.txt"} <= model_files
    assert any(k.endswith("evaluation/metrics.json") for k in keys)
    home = Path(stack.env["TRAINFLOW_HOME"])
    assert not [p for p in (home, REPO) for p in p.rglob("mlruns")]
    assert not (home / "mlartifacts").exists()


def test_mlflow_refuses_a_caller_without_credentials(stack, monkeypatch):
    from mlflow.exceptions import MlflowException

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(MlflowException) as refused:
        stack.mlflow().search_registered_models()
    assert refused.value.get_http_status_code() == 401


LOAD_AND_PREDICT = r"""
import json, sys
sys.path.append(sys.argv[1])  # the environment's packages only, not this checkout
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model("models:/digits-classifier@champion")
out = model.predict(pd.DataFrame({"image": [bytes.fromhex(h) for h in json.load(sys.stdin)]}))
print(json.dumps(list(out["label"])))
"""


def _digit_pngs(count: int) -> tuple[list[bytes], list[str]]:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = []
    for pixels in digits.images[:count]:
        buffer = io.BytesIO()
        Image.fromarray((pixels * 255 / 16).astype("uint8")).save(buffer, "PNG")
        images.append(buffer.getvalue())
    return images, [str(t) for t in digits.target[:count]]


def test_the_champion_loads_in_a_fresh_interpreter_with_only_the_url_and_credentials(
        stack, tmp_path):
    images, truth = _digit_pngs(40)
    only = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
            **{k: stack.client_env[k] for k in ("MLFLOW_TRACKING_URI",
                                                "MLFLOW_TRACKING_USERNAME",
                                                "MLFLOW_TRACKING_PASSWORD")}}
    done = subprocess.run([sys.executable, "-S", "-c", LOAD_AND_PREDICT,
                           sysconfig.get_paths()["purelib"]],
                          input=json.dumps([b.hex() for b in images]), env=only, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    labels = json.loads(done.stdout.strip().splitlines()[-1])
    assert sum(a == b for a, b in zip(labels, truth, strict=True)) >= 20  # chance: 4 of 40


def test_predict_flow_scores_with_the_champion_read_from_the_bucket(stack):
    out = prefect("deployment", "run", "predict-flow/digits-champion", "--watch",
                  env=stack.user_env)
    assert "Completed" in out
    client = stack.mlflow()
    scored = client.search_runs([client.get_experiment_by_name("predict-flow").experiment_id])
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert scored[0].data.metrics["images"] == 1797 and scored[0].data.metrics["errors"] == 0
    assert scored[0].data.tags["trainflow.model_version"] == champion.version
    wait_idle(stack)  # the run digits-champion's trigger started too


def wait_idle(stack: Stack, timeout: float = 300) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: stack.client_env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        while any(r.state is None or not r.state.is_final() for r in client.read_flow_runs()):
            assert time.monotonic() < deadline, "flow runs still running"
            time.sleep(2)


def _files_containing(root: Path, needles: list[bytes]) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
            and any(n in p.read_bytes() for n in needles)]


def test_no_credential_reaches_logs_parameters_mlflow_artifacts_or_the_workers_environment(
        stack):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    planted = [stack.keys.mlflow_password, stack.keys.s3_secret_key,
               stack.keys.postgres_password]
    # The worker's environment names the Secret block; it holds no password.
    worker = Path(f"/proc/{stack.pids()['worker']}/environ").read_bytes()
    assert b"TRAINFLOW_MLFLOW_SECRET_BLOCK" in worker
    assert not [s for s in planted if s.encode() in worker]

    with temporary_settings({PREFECT_API_URL: stack.client_env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        logs = client.read_logs(log_filter=LogFilter())
        tasks = client.read_task_runs()
    assert len(runs) >= 2 and logs
    text = "\n".join([*(f"{r.parameters} {r.job_variables}" for r in runs),
                      *(log.message for log in logs), *(str(t.task_inputs) for t in tasks)])
    assert not [s for s in planted if s in text]

    client = stack.mlflow()
    experiments = [e.experiment_id for e in client.search_experiments()]
    recorded = [f"{r.data.params} {r.data.tags}" for r in client.search_runs(experiments)]
    recorded += [f"{v.tags} {v.description}" for v in client.search_model_versions()]
    assert recorded and not [s for s in planted if any(s in r for r in recorded)]

    s3 = production_stack.s3_client(stack.folder)
    bucket = production_stack.BUCKET
    objects = [s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
               for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert len(objects) > 10
    assert not [s for s in planted if any(s.encode() in o for o in objects)]
    # Run folders, job files, progress events, decode stores; and every server's log.
    needles = [s.encode() for s in planted]
    assert _files_containing(Path(stack.env["TRAINFLOW_HOME"]), needles) == []
    assert [p for p in _files_containing(stack.folder, needles)
            if not p.endswith(("secrets.json", "client.env", "mlflow-auth.ini"))] == []


def test_a_wrong_password_fails_in_preflight_before_any_download(stack, tmp_path):
    env = {**stack.user_env, "MLFLOW_TRACKING_PASSWORD": "not-the-password",
           "TRAINFLOW_HOME": str(tmp_path / "home")}
    done = trainflow("train", "--dataset.source", "builtin:digits", env=env)
    assert done.returncode != 0
    assert "refused the credentials" in done.stdout + done.stderr
    assert "MLFLOW_TRACKING_PASSWORD" in done.stdout + done.stderr
    assert not (tmp_path / "home" / "datasets").exists()

    env = {**stack.env, "PREFECT_API_URL": stack.client_env["PREFECT_API_URL"],
           "MLFLOW_TRACKING_URI": stack.client_env["MLFLOW_TRACKING_URI"],
           "TRAINFLOW_MLFLOW_SECRET_BLOCK": "no-such-block", "TRAINFLOW_HOME": env["TRAINFLOW_HOME"]}
    done = trainflow("train", "--dataset.source", "builtin:digits", env=env)
    assert done.returncode != 0
    assert "Prefect Secret block 'no-such-block'" in done.stdout + done.stderr
    assert not (tmp_path / "home" / "datasets").exists()


def test_a_database_that_refuses_the_password_fails_in_preflight_without_showing_it(
        stack, tmp_path):
    """A team pointing MLFLOW_TRACKING_URI at its database, with a wrong password."""
    ports = json.loads((stack.folder / "ports.json").read_text())
    wrong = "wrong-db-password-8e1f"
    env = {**stack.user_env, "TRAINFLOW_HOME": str(tmp_path / "home"), "MLFLOW_TRACKING_URI":
           f"postgresql+psycopg://postgres:{wrong}@127.0.0.1:{ports['postgres']}/mlflow"}
    done = trainflow("train", "--dataset.source", "builtin:digits", env=env)
    assert done.returncode != 0
    assert "refused its user and password" in done.stdout + done.stderr
    assert wrong not in done.stdout + done.stderr
    assert not (tmp_path / "home" / "datasets").exists()


def test_a_stopped_bucket_fails_in_preflight_and_a_restart_keeps_every_version(
        stack, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.client_env["MLFLOW_TRACKING_URI"])
    client = stack.mlflow()
    before = client.get_model_version_by_alias(MODEL, "champion")
    runs_before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))

    s3_pid = stack.pids()["s3"]
    os.kill(s3_pid, 15)
    env = {**stack.user_env, "TRAINFLOW_HOME": str(tmp_path / "home")}
    done = trainflow("train", "--dataset.source", "builtin:digits", env=env)
    assert done.returncode != 0
    assert "artifact store" in done.stdout + done.stderr
    assert not (tmp_path / "home" / "datasets").exists()

    started = stack.pids()
    services.stop(stack.folder)
    assert not [name for name, pid in started.items() if alive(pid)]

    done = stack.start()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = stack.mlflow()
    after = client.get_model_version_by_alias(MODEL, "champion")
    assert (after.version, after.run_id) == (before.version, before.run_id)
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) \
        == runs_before
    # The artifacts came back too: moto replayed the requests it had recorded.
    from mlflow.artifacts import download_artifacts

    local = download_artifacts(f"models:/{MODEL}/{after.version}",
                               dst_path=str(tmp_path / "model"))
    assert (Path(local) / "artifacts" / "best.safetensors").stat().st_size > 1000
    again = stack.start()  # a second start keeps what runs
    assert again.returncode == 0 and again.stdout.count("already running") == 5


def test_the_bucket_keeps_a_multipart_object_across_a_restart(tmp_path):
    """An object over boto3's 8 MB multipart threshold (a model's weights), and one written
    after it, are there again when the stack's S3 server starts from its request log."""
    ports = production_stack._ports(tmp_path, production_stack.StackPorts(s3=free_port()))
    keys = production_stack.StackSecrets.load_or_create(tmp_path)
    weights = os.urandom(20 * 2**20)
    try:
        production_stack._start_s3(tmp_path, ports, keys)
        s3 = production_stack.s3_client(tmp_path)
        s3.upload_fileobj(io.BytesIO(weights), production_stack.BUCKET, "model/weights.bin")
        s3.put_object(Bucket=production_stack.BUCKET, Key="after.txt", Body=b"after")
        services.stop(tmp_path)
        production_stack._start_s3(tmp_path, ports, keys)
        s3 = production_stack.s3_client(tmp_path)
        read = lambda key: s3.get_object(  # noqa: E731
            Bucket=production_stack.BUCKET, Key=key)["Body"].read()
        assert read("model/weights.bin") == weights
        assert read("after.txt") == b"after"
    finally:
        services.stop(tmp_path)


def test_the_request_log_is_read_whole_when_two_entries_share_a_line(tmp_path):
    """moto writes an entry and its newline separately from concurrent threads (a multipart
    upload's parts): the next entry can land before the newline."""
    entries = [{"method": "PUT", "url": "/a?partNumber=1"}, {"method": "PUT", "url": "/a?n=2"},
               {"method": "POST", "url": "/a"}]
    log = tmp_path / "s3-requests.jsonl"
    log.write_text(json.dumps(entries[0]) + json.dumps(entries[1]) + "\n\n"
                   + json.dumps(entries[2]) + "\n")
    assert list(production_stack.recorded_requests(log)) == entries


def test_a_taken_port_is_named_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        done = trainflow("services", "start", "--stack", "production", "--folder",
                         tmp_path / "services", "--postgres-port", free_port(), "--s3-port",
                         taken, "--prefect-port", free_port(), "--mlflow-port", free_port(),
                         env=dict(os.environ))
    assert done.returncode != 0
    assert f"port {taken} (s3) is taken" in done.stderr and "--s3-port" in done.stderr
    assert not list((tmp_path / "services").glob("*.pid"))  # nothing was started
