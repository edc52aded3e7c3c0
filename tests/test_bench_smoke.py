"""The benchmark script runs end to end on a tiny setting (figures are not checked here)."""

import subprocess
import sys

import pytest


@pytest.mark.extended
@pytest.mark.slow
def test_bench_runs_on_a_tiny_setting():
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--pairs", "1", "--per-class", "10", "--epochs", "2",
         "--skip-flow", "--processes", "2", "--datasets", "jpeg"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    # input pipeline: header + ours, baseline; training: header + {jpeg} x {2 processes} x
    # {ours, baseline, ceiling}
    assert len(table) == (1 + 2) + (1 + 3)
    assert all(" | 2 | " in row for row in table[4:])
    assert "input pipeline alone, ours/baseline" in done.stdout
    assert "ours/baseline images/s" in done.stdout and "of the ceiling" in done.stdout


@pytest.mark.extended
@pytest.mark.slow
def test_the_gpu_benchmark_runs_in_its_cpu_mode():
    """bench/gpu.py must work the day a GPU machine is lent: its reduced mode runs here."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--cpu", "--repeats", "1"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "| 64 px, loader_workers 0 |" in out and "| 64 px, loader_workers 1 |" in out
    assert "| 64 px, loader_workers 0, crop+flip of the batch on the cpu |" in out
    assert "| fp32, channels_last True, cudnn.benchmark False | 16 |" in out
    assert "| 2 process(es) | 2 |" in out  # the end-to-end row ran real 2-process DDP
    assert "compile smoke: 2 processes with compile: true ran to loadable weights" in out
    assert "Profile of 20 steps" in out
