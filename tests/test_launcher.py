"""The launcher's own policies, on real child processes that stand in for `accelerate launch`."""

from __future__ import annotations

import logging
import socket
import sys

import pytest

from runtime import launcher
from training.config import TrainingSpec

LOG = logging.getLogger("test-launcher")
# Binds its rendezvous port as torchrun's store does, and fails as it does when it cannot.
STORE = """
import socket, sys
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", int(sys.argv[1])))
    s.listen()
    print("trained")
"""


def _store_on_the_launch_port(taken: list[socket.socket], steal_first: bool):
    """A launch_command that runs STORE on the port the launcher chose; the first time, another
    process (this test) listens there first."""
    def command(spec, module, args, port=None, env=None):
        port = spec.main_process_port or port
        if steal_first and not taken:
            thief = socket.socket()
            thief.bind(("127.0.0.1", port))
            thief.listen()
            taken.append(thief)
        return [sys.executable, "-c", STORE, str(port), "--main_process_port", str(port)]
    return command


def test_a_taken_rendezvous_port_is_retried_on_a_new_port(tmp_path, monkeypatch):
    taken: list[socket.socket] = []
    monkeypatch.setattr(launcher, "launch_command", _store_on_the_launch_port(taken, True))
    lines = []
    monkeypatch.setattr(LOG, "info", lambda fmt, *args: lines.append(fmt % args))
    try:
        launcher.launch(TrainingSpec(), "training.train", [], tmp_path, LOG, lambda event: None)
    finally:
        for s in taken:
            s.close()
    launched = [line for line in lines if line.startswith("launching: ")]
    assert len(launched) == 2 and "trained" in lines
    assert launched[0].split()[-1] != launched[1].split()[-1]  # on a new port


def test_a_taken_port_the_user_chose_is_an_error(tmp_path, monkeypatch):
    taken: list[socket.socket] = []
    monkeypatch.setattr(launcher, "launch_command", _store_on_the_launch_port(taken, True))
    try:
        with pytest.raises(launcher.PortTaken, match="port 29555 was taken"):
            launcher.launch(TrainingSpec(main_process_port=29555), "training.train", [],
                            tmp_path, LOG, lambda event: None)
    finally:
        for s in taken:
            s.close()


def test_a_failure_with_the_port_free_is_not_mistaken_for_a_taken_port(tmp_path, monkeypatch):
    port = launcher.free_port()
    monkeypatch.setattr(launcher, "launch_command", lambda *a, **k: [
        sys.executable, "-c", "raise SystemExit('out of memory')", "--main_process_port",
        str(port)])
    with pytest.raises(launcher.LaunchFailed) as failed:
        launcher.launch(TrainingSpec(), "training.train", [], tmp_path, LOG, lambda e: None)
    assert not isinstance(failed.value, launcher.PortTaken)


def test_a_machine_of_several_joins_by_c10d_and_only_machine_0_hosts_the_store():
    def options(**fields) -> list[str]:
        spec = TrainingSpec(num_processes=2, num_machines=2, main_process_ip="10.0.0.5",
                            main_process_port=29555, rendezvous_timeout_s=45, **fields)
        command = launcher.launch_command(spec, "training.train", [])
        return command[command.index("--num_processes"):command.index("-m", 3)]

    zero, one = options(machine_rank=0), options(machine_rank=1, max_restarts=2)
    assert zero[zero.index("--num_processes") + 1] == "4"  # processes of all machines
    assert zero[zero.index("--rdzv_backend") + 1] == "c10d"
    assert zero[zero.index("--rdzv_conf") + 1] == "is_host=1,join_timeout=45"
    assert one[one.index("--rdzv_conf") + 1] == "is_host=0,join_timeout=45"
    assert one[one.index("--machine_rank") + 1] == "1"
    assert one[one.index("--max_restarts") + 1] == "2" and "--max_restarts" not in zero
    with pytest.raises(ValueError, match="needs training.main_process_ip"):
        launcher.launch_command(TrainingSpec(num_machines=2), "training.train", [])


@pytest.mark.parametrize("cuda, exported, forced, expected", [
    (False, None, None, "1"),   # a CPU host: real DDP on gloo needs it
    (True, "1", None, None),    # a GPU host: an exported CPU switch is dropped
    (True, "1", "1", "1"),      # unless the user asks for the CPU explicitly
])
def test_the_cpu_switch_reaches_a_launch_only_where_meant(monkeypatch, cuda, exported, forced,
                                                          expected):
    monkeypatch.setattr(launcher, "cuda_available", lambda: cuda)
    for name, value in (("ACCELERATE_USE_CPU", exported), ("TRAINFLOW_FORCE_CPU", forced)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert launcher.launch_env().get("ACCELERATE_USE_CPU") == expected


@pytest.mark.slow
def test_a_real_launch_whose_port_another_process_holds_is_port_taken(tmp_path):
    """torchrun's own failure to bind, recognised without reading its message."""
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        spec = TrainingSpec(num_processes=2, main_process_port=thief.getsockname()[1])
        with pytest.raises(launcher.PortTaken):
            launcher.launch(spec, "training.train", ["--job", str(tmp_path / "none.json")],
                            tmp_path, LOG, lambda event: None)
