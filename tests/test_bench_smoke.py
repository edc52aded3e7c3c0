"""The benchmark script runs end to end on a tiny setting (figures are not checked here)."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_runs_on_a_tiny_setting():
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--pairs", "1", "--per-class", "10", "--epochs", "2",
         "--skip-flow"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    # input pipeline: header + ours, baseline; training: header + {jpeg, digits} x
    # {1, 2 processes} x {ours, baseline, ceiling}
    assert len(table) == (1 + 2) + (1 + 12)
    assert "input pipeline alone, ours/baseline" in done.stdout
    assert "ours/baseline images/s" in done.stdout and "of the ceiling" in done.stdout
