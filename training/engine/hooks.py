"""Code that runs inside every rank at fixed moments, chosen from outside the product.

TRAINFLOW_RANK_HOOKS names a Python file (or an importable module) that defines any of

    on_step(rank: int, epoch: int, step: int)    after each training batch is loaded
    on_decode_progress(done: int, total: int)    while a rank decodes the store, holding its lock

The fault-tolerance tests inject their faults this way (tests/faults.py), so that no test
branch sits in the training code. Unset, nothing is imported and every hook does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

HOOKS_ENV = "TRAINFLOW_RANK_HOOKS"


def _nothing(*args: int) -> None:
    return None


@dataclass(frozen=True)
class RankHooks:
    on_step: Callable[[int, int, int], None] = _nothing
    on_decode_progress: Callable[[int, int], None] = _nothing


@cache
def rank_hooks() -> RankHooks:
    where = os.environ.get(HOOKS_ENV)
    if not where:
        return RankHooks()
    module = _load(where)
    return RankHooks(**{name: getattr(module, name) for name in RankHooks.__dataclass_fields__
                        if hasattr(module, name)})


def _load(where: str) -> ModuleType:
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    spec = importlib.util.spec_from_file_location(f"_rank_hooks_{path.stem}", path)
    if spec is None or not path.is_file():
        raise FileNotFoundError(f"{HOOKS_ENV}={where}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
