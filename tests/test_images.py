"""The worker image and the deployments that use it. No Docker engine here: what is checked is
that the image installs exactly the lock and copies only code, and that the Kubernetes
deployments run the image they build."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())  # join continued lines
    return [(line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1]) for line in
            text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_image_installs_the_lock_and_nothing_unpinned():
    steps = _instructions()
    [base] = [arg for op, arg in steps if op == "FROM"]
    locked_python = re.search(r"--python-version (\S+)", (REPO / "Makefile").read_text())[1]
    assert base == f"python:{locked_python}-slim"
    installs = [arg for op, arg in steps if op == "RUN" and "pip install" in arg]
    assert installs == ["pip install -r requirements.lock", "pip install --no-deps ."]
    # the lock is copied before it is installed, and the project only after
    order = [(op, arg) for op, arg in steps if op in ("COPY", "RUN")]
    assert order.index(("COPY", "requirements.lock ./")) < order.index(
        ("RUN", "pip install -r requirements.lock"))
    locked = (REPO / "requirements.lock").read_text()
    assert re.search(r"^torch==\S+", locked, re.M)  # the CUDA build from PyPI, pinned
    assert re.search(r"^nvidia-cudnn-cu\d+==\S+", locked, re.M)


def test_the_image_holds_code_only():
    copied = set()
    for op, arg in _instructions():
        if op == "COPY":
            *sources, _ = shlex.split(arg)
            copied.update(sources)
    assert copied == {"requirements.lock", "pyproject.toml", "prefect.yaml", "training", "runtime", "tasks",
                      "flows", "commands", "trainflow_serving"}
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"  # everything else of the build context stays out
    assert {line[1:].rstrip("/") for line in ignore if line.startswith("!")} == copied


def test_kubernetes_deployments_run_the_image_they_build():
    spec = yaml.safe_load((REPO / "deploy" / "kubernetes" / "prefect.yaml").read_text())
    [_, build] = spec["build"]
    assert build["prefect_docker.deployments.steps.build_docker_image"]["dockerfile"] == (
        "deploy/docker/Dockerfile")
    for deployment in spec["deployments"]:
        assert deployment["work_pool"]["job_variables"]["image"] == "{{ build-image.image }}"
        assert (REPO / deployment["entrypoint"].split(":")[0]).is_file()
    [pull, results] = spec["pull"]
    workdir = [arg for op, arg in _instructions() if op == "WORKDIR"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == workdir[-1]
    # The step that saves the results block for a remote root is the project's own code.
    [(step, inputs)] = results.items()
    from prefect.utilities.importtools import import_object

    assert callable(import_object(step)) and inputs == {}
