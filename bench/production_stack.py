"""The digits deployment through a worker on the production stack against the local (SQLite)
stack, alternated in one invocation, then predict-flow on 2,000 images on each.

    .venv/bin/python -m bench.production_stack --pairs 3

Both stacks run side by side on free ports, each with its own home; each run is
`prefect deployment run train-flow/digits --watch` with force (every run trains and registers).
Prints the medians of the whole run's wall time, of register_model's and of the flow run's own
time; then predict-flow on 2,000 PNG digits in a folder, where the production stack reads the
champion from the S3 bucket through MLflow's proxy.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from commands import production_stack, services
from training.processes import free_port

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(services.BIN / "prefect")
TRAINING = {"epochs": 2, "num_processes": 2}


def start_stacks(root: Path) -> dict[str, dict]:
    stacks = {}
    for name in ("local", "production"):
        base = {**os.environ, "TRAINFLOW_HOME": str(root / name / "home"),
                "PREFECT_HOME": str(root / name / "prefect"), "PWD": str(REPO)}
        for variable in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "MLFLOW_TRACKING_USERNAME",
                         "MLFLOW_TRACKING_PASSWORD"):
            base.pop(variable, None)
        os.environ.update({k: base[k] for k in ("TRAINFLOW_HOME", "PREFECT_HOME")})
        folder = root / name / "services"
        if name == "local":
            env = services.start(folder, free_port(), free_port(), extra_env=base)
        else:
            production_stack.start(folder, production_stack.StackPorts(
                free_port(), free_port(), free_port(), free_port()), extra_env=base)
            env = {**base, **production_stack.client_env(folder)}
        stacks[name] = {"env": {**base, **env}, "folder": folder}
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--name", "digits", "--name",
                                   "digits-champion"], cwd=REPO, env=stacks[name]["env"],
                                  capture_output=True, text=True)
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    return stacks


def run(env: dict, deployment: str, *params: str) -> tuple[float, str]:
    command = [PREFECT, "deployment", "run", deployment, "--watch"]
    for param in params:
        command += ["--param", param]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0 or "Completed" not in done.stdout:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-2000:])
    return seconds, re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout).group(1)


def stages(env: dict, flow_run_id: str) -> dict[str, float]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from commands.train import stage_seconds

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        found = stage_seconds(flow_run_id)
        with get_client(sync_client=True) as client:
            found["flow"] = client.read_flow_run(flow_run_id).total_run_time.total_seconds()
    return found


def digit_folder(folder: Path, count: int) -> Path:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = digits.images[i % len(digits.images)]
        buffer = io.BytesIO()
        Image.fromarray((pixels * 255 / 16).astype("uint8")).save(buffer, "PNG")
        (folder / f"{i:05d}.png").write_bytes(buffer.getvalue())
    return folder


def wait_idle(env: dict) -> None:
    """The digits-champion trigger starts a scoring run after each training: let it end."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        time.sleep(3)
        while any(r.state is None or not r.state.is_final() for r in client.read_flow_runs()):
            time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--images", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-stack-"))
    stacks = start_stacks(root)
    results = {name: {"wall": [], "flow": [], "register_model": [], "predict": [],
                      "predict_flow": [], "resolve": []} for name in stacks}
    images = digit_folder(root / "images", args.images)
    try:
        for pair in range(args.pairs):
            order = list(stacks) if pair % 2 == 0 else list(reversed(stacks))
            for name in order:
                env = stacks[name]["env"]
                wait_idle(env)
                wall, run_id = run(env, "train-flow/digits", f"training={json.dumps(TRAINING)}",
                                   "force=true")
                found = stages(env, run_id)
                results[name]["wall"].append(wall)
                results[name]["flow"].append(found["flow"])
                results[name]["register_model"].append(found["register_model"])
                print(f"{name:10s} train run {pair}: {wall:.1f} s, flow {found['flow']:.1f} s, "
                      f"register_model {found['register_model']:.2f} s", flush=True)
            for name in order:
                env = stacks[name]["env"]
                wait_idle(env)
                wall, run_id = run(env, "predict-flow/digits-champion", f"images={images}")
                found = stages(env, run_id)
                results[name]["predict"].append(wall)
                results[name]["predict_flow"].append(found["flow"])
                results[name]["resolve"].append(found.get("resolve_model", float("nan")))
                print(f"{name:10s} predict {args.images} images {pair}: {wall:.1f} s, flow "
                      f"{found['flow']:.1f} s, resolve_model {found.get('resolve_model', 0):.2f} s",
                      flush=True)
    finally:
        for stack in stacks.values():
            services.stop(stack["folder"])
    print(f"\nmedians of {args.pairs} alternated runs (digits, {TRAINING}, 2 processes)")
    print(f"{'':12s}{'run wall':>10s}{'flow':>8s}{'register':>10s}{'predict wall':>14s}"
          f"{'predict flow':>14s}{'model fetch':>13s}")
    median = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    for name, m in median.items():
        print(f"{name:12s}{m['wall']:10.1f}{m['flow']:8.1f}{m['register_model']:10.2f}"
              f"{m['predict']:14.1f}{m['predict_flow']:14.1f}{m['resolve']:13.2f}")
    print(f"production / local, run wall: {median['production']['wall'] / median['local']['wall']:.2f}x")


if __name__ == "__main__":
    main()
