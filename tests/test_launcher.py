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

    def command(spec, module, args, port=None):
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
