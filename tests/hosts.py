"""Two real network hosts on one machine: network namespaces on a bridge, each with a Prefect
process worker on its own work queue, and a Prefect server on the bridge that both reach.

    with two_hosts(folder, env) as hosts: ...   # needs root; always torn down

Host i is namespace `hosts.names[i]` at `hosts.addresses[i]`; its worker polls the work queue
`machine-<i>` of `hosts.pool`, where the `train-node/nodes` deployment (prefect.yaml) lives.
The file system is shared, as a cluster's shared storage would be; `start_worker` can give a
worker a home of its own and hide the others'.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers import started
from training.processes import free_port, kill_tree

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
LINK = "tfnet0"  # the interface name inside each namespace


@dataclass
class Hosts:
    names: list[str]
    addresses: list[str]
    gateway: str
    api: str
    pool: str
    env: dict
    folder: Path
    workers: list[subprocess.Popen] = field(default_factory=list)

    def run_in(self, host: int, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[host], *command],
                              capture_output=True, text=True, **kwargs)

    def pids(self, host: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def start_worker(self, host: int, queue: str, env: dict | None = None,
                     hidden: list[Path] = (), disk: dict[Path, Path] | None = None
                     ) -> subprocess.Popen:
        """A process worker on `host` polling `queue`, with `env` over the hosts' own,
        `hidden` folders out of its sight (an empty file system mounted over each in its own
        mount namespace), as another machine would not see this one's disk, and `disk`
        ({path: folder}) each path showing a folder of this host's own, as every machine of a
        cluster has its own disk at one path."""
        covers = " && ".join(
            [f"mkdir -p {shlex.quote(str(p))} && mount -t tmpfs hidden {shlex.quote(str(p))}"
             for p in hidden]
            + [f"mkdir -p {shlex.quote(str(at))} && mount --bind {shlex.quote(str(own))} "
               f"{shlex.quote(str(at))}" for at, own in (disk or {}).items()])
        # A worker polls only queues that exist; "already exists" is fine.
        subprocess.run([str(BIN / "prefect"), "work-queue", "create", queue, "--pool",
                        self.pool], env=self.env, cwd=REPO, capture_output=True, timeout=120)
        with open(self.folder / f"worker-{queue}.log", "ab") as log:
            worker = subprocess.Popen(
                ["ip", "netns", "exec", self.names[host], "unshare", "--mount", "--propagation",
                 "private", "sh", "-c", f'{covers or "true"} && exec "$@"', "worker",
                 str(BIN / "prefect"), "worker", "start", "--pool", self.pool, "--work-queue",
                 queue, "--type", "process", "--name", f"worker-{queue}"],
                env={**self.env, **(env or {})}, cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.workers.append(worker)
        return worker

    def kill_launch(self, host: int) -> int:
        """SIGKILL the `accelerate launch` on `host` (its ranks die with it), as a lost machine."""
        for pid in self.pids(host):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"accelerate.commands.launch" in f.read():
                    os.kill(pid, 9)
                    return pid
        raise AssertionError(f"no launch running on host {host}")

    def received_bytes(self, host: int) -> int:
        return int(self.run_in(host, ["cat", f"/sys/class/net/{LINK}/statistics/rx_bytes"]
                               ).stdout)


def namespaces_possible() -> str | None:
    """None, or why network namespaces cannot be made here."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"tfprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    command = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


@contextlib.contextmanager
def network(count: int = 2) -> Iterator[tuple[list[str], list[str], str]]:
    """`count` namespaces on one bridge in a private /24 used only here."""
    tag = f"{os.getpid() % 10000}{random.randint(0, 9)}"
    subnet = f"10.213.{random.randint(1, 250)}"
    bridge, names = f"tfbr{tag}", [f"tfh{i}x{tag}" for i in range(count)]
    addresses = [f"{subnet}.{i + 2}" for i in range(count)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (name, address) in enumerate(zip(names, addresses, strict=True)):
            _ip("netns", "add", name)
            outside = f"tfv{i}x{tag}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", LINK, "netns", name)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("addr", "add", f"{address}/24", "dev", LINK, ns=name)
            _ip("link", "set", LINK, "up", ns=name)
            _ip("link", "set", "lo", "up", ns=name)
        yield names, addresses, f"{subnet}.1"
    finally:
        for name in names:
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in out.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@contextlib.contextmanager
def two_hosts(folder: Path, extra_env: dict, count: int = 2) -> Iterator[Hosts]:
    folder.mkdir(parents=True, exist_ok=True)
    with network(count) as (names, addresses, gateway):
        port = free_port(gateway)
        api = f"http://{gateway}:{port}/api"
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               "PREFECT_API_URL": api, "PREFECT_HOME": str(folder / "prefect"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
               "PREFECT_WORKER_QUERY_SECONDS": "1",
               "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "2", "PWD": str(REPO), **extra_env}
        server = [str(BIN / "prefect"), "server", "start", "--host", gateway, "--port", str(port)]
        with started(server, f"{api}/health", folder / "server.log", env=env):
            pool = "nodes-pool"
            for command in (["work-pool", "create", pool, "--type", "process"],
                            ["--no-prompt", "deploy", "--name", "nodes", "--pool", pool]):
                done = subprocess.run([str(BIN / "prefect"), *command], cwd=REPO, env=env,
                                      capture_output=True, text=True, timeout=180)
                assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            hosts = Hosts(names, addresses, gateway, api, pool, env, folder)
            try:
                for i in range(count):
                    hosts.start_worker(i, f"machine-{i}")
                wait_ready(hosts, [f"machine-{i}" for i in range(count)])
                yield hosts
            finally:
                for worker in hosts.workers:
                    kill_tree(worker)


def wait_ready(hosts: Hosts, queues: list[str], timeout: float = 120) -> None:
    """Until a worker polls each of `queues`."""
    from prefect import get_client
    from prefect.client.schemas.objects import WorkQueueStatus
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: hosts.api}), get_client(sync_client=True) as c:
        while time.monotonic() < deadline:
            ready = 0
            for queue in queues:
                with contextlib.suppress(ObjectNotFound):
                    found = c.read_work_queue_by_name(queue, work_pool_name=hosts.pool)
                    ready += found.status == WorkQueueStatus.READY
            if ready == len(queues):
                return
            time.sleep(1)
    raise TimeoutError(f"no worker polled some of {queues} within {timeout} s")
