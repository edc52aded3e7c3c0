"""The launcher's own policies, on real child processes that stand in for `accelerate launch`."""

from __future__ import annotations

import logging
import sys

import pytest

from tasks import launcher
from training.config import TrainingSpec

LOG = logging.getLogger("test-launcher")
# Fails like torchrun does when another launch took its port between choice and bind, once.
FLAKY = """
import pathlib, sys
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.write_text("taken")
    print("RuntimeError: The server socket has failed to listen on any local network address. "
          "port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use")
    sys.exit(1)
print("trained")
"""


def test_a_taken_rendezvous_port_is_retried_on_a_new_port(tmp_path, monkeypatch):
    commands = []

    def command(spec, module, args, port=None, env=None):
        commands.append(launcher.free_port())
        return [sys.executable, "-c", FLAKY, str(tmp_path / "taken")]

    monkeypatch.setattr(launcher, "launch_command", command)
    lines = []
    monkeypatch.setattr(LOG, "info", lambda fmt, *args: lines.append(fmt % args))
    launcher.launch(TrainingSpec(), "training.train", [], tmp_path, LOG, lambda event: None)
    assert len(commands) == 2 and "trained" in lines


def test_a_taken_port_the_user_chose_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "launch_command", lambda *a, **k: [
        sys.executable, "-c", FLAKY, str(tmp_path / "taken")])
    with pytest.raises(launcher.PortTaken):
        launcher.launch(TrainingSpec(main_process_port=29555), "training.train", [], tmp_path,
                        LOG, lambda event: None)


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
