"""Deliberate faults for the fault-tolerance tests: a rank hook module (training/engine/hooks.py),
which conftest.py names in TRAINFLOW_RANK_HOOKS for every process the tests start.

TRAINFLOW_FAULT="<kind>:rank=<r>:epoch=<e>:step=<s>" with kind one of
  raise  - the rank raises RuntimeError at that step
  hang   - the rank stops making progress (sleeps for an hour)
  slow   - every step of that rank sleeps <s> seconds (rank/epoch ignored unless given)
  kill   - the rank SIGKILLs itself at that step
  preempt - the rank SIGTERMs its launcher (torchrun's agent) at that step, as a spot notice does
  slow_decode - the rank that decodes the store sleeps <seconds> once, holding its lock
With TRAINFLOW_FAULT_ONCE=<file>, a fault fires only while <file> does not exist (it is created
when the fault fires), so a retried attempt runs clean.
Without TRAINFLOW_FAULT the hooks do nothing.
"""

from __future__ import annotations

import os
import signal
import time
from functools import cache


@cache
def _fault() -> dict | None:
    text = os.environ.get("TRAINFLOW_FAULT")
    if not text:
        return None
    kind, *fields = text.split(":")
    spec = {"kind": kind}
    for field in fields:
        key, _, value = field.partition("=")
        spec[key] = float(value)
    return spec


def on_step(rank: int, epoch: int, step: int) -> None:
    fault = _fault()
    if fault is None or fault.get("rank", rank) != rank:
        return
    if fault["kind"] == "slow":
        time.sleep(fault.get("step", 0.1))
        return
    if fault.get("epoch", epoch) != epoch or fault.get("step", step) != step:
        return
    once = os.environ.get("TRAINFLOW_FAULT_ONCE")
    if once:
        if os.path.exists(once):
            return
        open(once, "w").close()
    if fault["kind"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault["kind"] == "preempt":
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(3)  # a notice takes a moment to reach every rank; the others wait here too
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at epoch {epoch} step {step}")
    if fault["kind"] == "hang":
        time.sleep(3600)


def on_decode_progress(done: int, total: int) -> None:
    fault = _fault()
    if fault is not None and fault["kind"] == "slow_decode" and not fault.get("slept"):
        fault["slept"] = True
        time.sleep(fault.get("seconds", 1.0))
