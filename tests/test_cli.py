"""`trainflow` as a person types it: help, bad values, a config file, the reused local server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from training.config import TrainingSpec
from training.processes import alive

BIN = Path(sys.executable).parent
TRAINFLOW = str(BIN / "trainflow")


def _clean_env(tmp_path: Path) -> dict:
    """A fresh machine's environment: no Prefect or MLflow settings, homes under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))
           and k not in ("DO_NOT_TRACK", "TRAINFLOW_HOME")}
    return {**env, "HOME": str(tmp_path), "TRAINFLOW_HOME": str(tmp_path / "trainflow")}


def test_help_lists_every_field_and_exits_zero(tmp_path):
    done = subprocess.run([TRAINFLOW, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "trainflow train" in done.stdout
    done = subprocess.run([TRAINFLOW, "train", "--help"], capture_output=True, text=True,
                          timeout=60, env=_clean_env(tmp_path))
    assert done.returncode == 0, done.stderr
    for flag in ("--dataset.source str", "--training.epochs int", "--training.mixed_precision",
                 "--registry.approval {auto,manual}", "--config", "--json"):
        assert flag in done.stdout, flag
    text = " ".join(done.stdout.split())  # as argparse wrapped it
    assert ("Square input size in pixels. Default: 224 with pretrained weights or a weights "
            "file (the ImageNet habit;") in text
    assert "the smallest it takes when it cannot. (default: 28)" in text


@pytest.mark.parametrize("argv, message", [
    (["--training.epochs", "x"], "training.epochs: Input should be a valid integer"),
    (["--training.epochs", "0"], "training.epochs: Input should be greater than or equal to 1"),
    (["--training.model", "resnet-18"], "unknown model 'resnet-18'"),
    (["--training.epoch", "3"], "unrecognized arguments: --training.epoch"),
    (["--dataset.source", "s3:bucket"], "unknown dataset source scheme 's3'"),
    (["--search_space", '{"lr": {"range": [1, 2]}}'], "search_space.lr.range: Extra inputs"),
    (["--search_space", '{"epochs": {"choice": [1, 2]}}'], "not searchable training fields"),
])
def test_bad_values_are_refused_before_any_server(tmp_path, argv, message):
    command = "sweep" if "--search_space" in argv else "train"
    _refused_before_any_server(tmp_path, [TRAINFLOW, command, *argv], message)


@pytest.mark.parametrize("config, message", [
    ('{"training": {"model": "resnet-18"}}',
     'training.model: unknown model \'resnet-18\'; use "basicnet", "resnet18"'),
    ('{"split": {"val_fraction": 0.7, "test_fraction": 0.5}}', "leaves no training data"),
    ('{"training": {"epochs": 3}', "is not YAML or JSON"),
    ("[1, 2]", "holds list, not the parameter blocks"),
])
def test_a_config_file_with_bad_values_is_refused_in_one_line_before_any_server(
        tmp_path, config, message):
    (tmp_path / "run.json").write_text(config)
    _refused_before_any_server(tmp_path, [TRAINFLOW, "train", "--config",
                                          str(tmp_path / "run.json")], message)


def _refused_before_any_server(tmp_path: Path, command: list[str], message: str) -> None:
    env = _clean_env(tmp_path)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    finally:  # had a bad value slipped through, the server it started must not outlive us
        subprocess.run([TRAINFLOW, "services", "stop", "--folder", str(tmp_path / "svc")],
                       capture_output=True, timeout=60, env=env)
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    # Importing the flow module imports Prefect, which makes its home; nothing more may start.
    prefect_home = tmp_path / ".prefect"
    assert not {"trainflow-server.json", "prefect.db"} & {p.name for p in prefect_home.glob("*")}
    assert command[0] != TRAINFLOW or not prefect_home.exists(), "Prefect was imported"


def test_the_flows_load_and_check_without_what_only_the_ranks_need(tmp_path):
    """A hand-started run pays for importing its flow and for the checks before its launch:
    torch (about 3 s here) and matplotlib belong to the ranks and to drawing. On a machine
    without a GPU driver, "auto" processes are decided without torch too."""
    probe = """
import sys
import flows.train_flow, flows.sweep_flow, flows.predict_flow
print(sorted(m for m in ('torch', 'torchvision', 'matplotlib') if m in sys.modules))
from runtime.launcher import launch_command, launch_env
from tasks.lineage import spec_hash
from tasks.preflight import check_before_start
from training.config import DatasetSpec, SplitSpec, TrainingSpec
training = TrainingSpec(num_processes="auto")
check_before_start.fn(DatasetSpec(source="builtin:digits"), training)
spec_hash(training, SplitSpec())
print(launch_command(training, "training.train", [], env=launch_env()))
print(sorted(m for m in ('torch', 'torchvision', 'matplotlib') if m in sys.modules))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1],
                          env={**env, "TRAINFLOW_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    imported, launch, checked = done.stdout.splitlines()[-3:]
    assert imported == "[]"
    # "auto": this machine's GPUs, or 2 processes on a CPU machine with 2 cores or more
    assert f"'--num_processes', '{TrainingSpec().resolved_num_processes()}'" in launch
    assert checked == "[]"


@pytest.mark.slow
def test_hand_started_flows_share_one_local_server_on_a_busy_machine(tmp_path):
    """Every core busy, fresh home: the first run starts the local server and completes; the
    second, from Python (commands.python_api.train), reuses it; `trainflow services stop` ends
    it."""
    env = _clean_env(tmp_path)
    config = tmp_path / "digits.yaml"
    config.write_text("dataset:\n  source: builtin:digits\ntraining:\n  image_size: 12\n"
                      "  batch_size: 50\n  epochs: 5\nregistry:\n  model_name: cli-digits\n")
    try:
        _two_runs_and_a_stop(tmp_path, env, config)
    finally:  # whatever failed, no server is left behind
        subprocess.run([TRAINFLOW, "services", "stop", "--folder", str(tmp_path / "svc")],
                       capture_output=True, timeout=60, env=env)


def _two_runs_and_a_stop(tmp_path: Path, env: dict, config: Path) -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(os.cpu_count() or 2)]
    try:
        first = subprocess.run([TRAINFLOW, "train", "--config", str(config),
                                "--training.epochs", "3"], capture_output=True, text=True,
                               timeout=900, env=env)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "starting a local Prefect server" in first.stderr
    # Quiet on a fresh home: no error line, no traceback, no start-up time-out.
    for bad in ("Timed out", "Traceback", "| ERROR"):
        assert bad not in first.stderr + first.stdout, bad
    for epoch in (1, 2, 3):  # one line per epoch
        assert (first.stdout + first.stderr).count(f"epoch {epoch}/3 train_loss=") == 1, epoch
    # Progress bars and library chatter: MLflow's, and Accelerate's routine checkpoint rotation
    # (the third epoch's checkpoint replaces the first).
    for noise in ("Downloading artifacts", " INFO mlflow", "Created version",
                  "already exists. Creating a new version",
                  "checkpoints to make room"):
        assert noise not in first.stderr + first.stdout, noise
    record = json.loads((tmp_path / ".prefect" / "trainflow-server.json").read_text())
    lines = first.stdout.splitlines()
    # The summary: the config's model name and image size, the flag's epochs.
    auto = TrainingSpec().resolved_num_processes()  # what "auto" starts on this machine
    assert any(re.match(rf"training  world size {auto}, best epoch [123] of 3 ", line)
               for line in lines)
    assert any(line.startswith("registry  cli-digits v1: test_accuracy") and "promoted" in line
               for line in lines), first.stdout[-2000:]
    assert any(line.startswith("prefect   " + record["url"].removesuffix("/api"))
               for line in lines)
    # The default store is a file: the summary says how to open the MLflow link it gives.
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'trainflow' / 'mlflow.db'}" in first.stdout
    # Digits' test split has about 18 images a class: the gate's warning is said once, as a
    # warning, and again in the summary's registry line.
    small = [line for line in (first.stderr + first.stdout).splitlines()
             if "the test split has only" in line]
    assert len(small) == 2 and "| WARNING |" in small[0] and small[1].startswith("registry  "), \
        small

    # The same run from Python, through the documented function: the same server, reused.
    again = ('from commands.python_api import train\n'
             'print(train(dataset={"source": "builtin:digits"}, training={"image_size": 12, '
             '"batch_size": 50, "epochs": 3}, registry={"model_name": "cli-digits"})'
             '.model_dump_json())')
    second = subprocess.run([sys.executable, "-c", again], capture_output=True, text=True,
                            timeout=600, env=env, cwd=Path(__file__).parents[1])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "starting a local Prefect server" not in second.stderr
    assert "champion v1 already trained" in json.loads(second.stdout.splitlines()[-1])["skipped"]
    assert json.loads((tmp_path / ".prefect" / "trainflow-server.json").read_text()) == record

    stop = subprocess.run([TRAINFLOW, "services", "stop", "--folder", str(tmp_path / "svc")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert f"stopped the local Prefect server (pid {record['pid']}" in stop.stdout, stop.stderr
    assert not alive(record["pid"])
