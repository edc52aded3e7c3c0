"""Installs that do not drift: the environment is the lock, and every import is declared."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("training", "tasks", "flows", "commands")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _locked() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_name(name).replace(".", "-")] = version
    return pins


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    locked = [r for extra, requirements in extras.items() if extra != "gpu"  # outside the lock
              for r in requirements]
    return {_name(r) for r in project["dependencies"] + locked}


def test_every_locked_package_is_installed_at_its_locked_version():
    installed = {d.metadata["Name"].lower().replace("_", "-").replace(".", "-"): d.version
                 for d in importlib.metadata.distributions()}
    drift = {name: (version, installed.get(name)) for name, version in _locked().items()
             if installed.get(name, "").split("+")[0] != version}
    assert not drift, f"installed differs from requirements.lock (run make install): {drift}"


def test_every_declared_dependency_is_locked():
    missing = {name for name in _declared() if name != "trainflow"} - set(_locked())
    assert not missing, f"run make lock: {missing}"


def test_every_module_the_product_imports_is_declared():
    modules = set()
    for package in PRODUCT:
        for file in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    third_party = modules - set(sys.stdlib_module_names) - set(PRODUCT) - {"__future__"}
    owners = importlib.metadata.packages_distributions()
    undeclared = {m: owners.get(m) for m in third_party
                  if not {_name(d) for d in owners.get(m, [])} & _declared()}
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def test_the_gpu_extra_adds_pynvml_alone_to_the_locked_environment():
    """What `make install` runs on a machine with nvidia-smi: nothing locked moves."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-c",
                           "requirements.lock", "-e", ".[dev,gpu]"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [would] = [line for line in done.stdout.splitlines() if line.startswith("Would install")]
    added = {_name(p.rsplit("-", 1)[0]) for p in would.removeprefix("Would install ").split()}
    assert added == {"nvidia-ml-py", "trainflow"}
