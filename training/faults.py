"""Process hygiene and deliberate faults for the fault-tolerance tests.

TRAINFLOW_FAULT="<kind>:rank=<r>:epoch=<e>:step=<s>" with kind one of
  raise  - the rank raises RuntimeError at that step
  hang   - the rank stops making progress (sleeps for an hour)
  slow   - every step of that rank sleeps <s> seconds (rank/epoch ignored unless given)
  kill   - the rank SIGKILLs itself at that step
With TRAINFLOW_FAULT_ONCE=<file>, a fault fires only while <file> does not exist (it is created
when the fault fires), so a retried attempt runs clean.
Unset in production; read once per step, costs a dict lookup.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
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


def inject_fault(rank: int, epoch: int, step: int) -> None:
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
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at epoch {epoch} step {step}")
    if fault["kind"] == "hang":
        time.sleep(3600)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies.

    Ranks use SIGKILL (a hard-killed `accelerate launch` would otherwise leave them running,
    holding memory and the rendezvous port); the launcher itself uses SIGTERM, so that a
    flow-run process killed by its worker still takes the whole launch down with it.
    """
    if sys.platform != "linux":
        return
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
