"""A user's own package, importable by this test and by the ranks it launches, nowhere else."""

from __future__ import annotations

from pathlib import Path


def install_package(folder: Path, monkeypatch, package: str, modules: dict[str, str]) -> Path:
    """folder/<package>/<module>.py for each of `modules` (name -> source), on this process's
    path and on PYTHONPATH (which the ranks inherit)."""
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("")
    for name, source in modules.items():
        (folder / package / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return folder
