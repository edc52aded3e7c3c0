"""CI's short soak: 4 digits flow runs against one stack, 2 with faults, then the audit
(bench/soak.py; `make soak` is the long one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.extended]


def test_a_short_soak_with_a_killed_rank_and_a_restarted_mlflow_server_leaves_nothing_behind():
    done = subprocess.run([sys.executable, "-m", "bench.soak", "--runs", "4", "--faults", "2",
                           "--kinds", "kill_rank,mlflow_restart", "--interval", "3",
                           "--timeout", "900"], capture_output=True, text=True, timeout=1200)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    summary = next(line for line in done.stdout.splitlines() if line.startswith("runs 4,"))
    assert "faults 2 (kill_rank 1, mlflow_restart 1)" in summary
    assert "recovered 2 of 2" in summary and "completed 4" in summary
    assert "versions 4" in summary and "leftovers 0" in summary
