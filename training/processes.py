"""Process utilities shared by the launcher, the services command and the tests.

Also runnable, as the launcher's safe way to tie a child to its parent:

    python -m training.processes --die-with-parent TERM -- accelerate launch ...

sets the Linux parent-death signal and then execs the command. The signal survives exec, and
setting it here avoids `Popen(preexec_fn=...)`, which Python documents as unsafe once the
parent runs threads (a Prefect task process always does).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys

import psutil

TERMINATE_GRACE_S = 5.0


MACHINE_RANK = "TRAINFLOW_MACHINE_RANK"
"""Set by the launcher on a launch that is one machine of several: that machine's rank
(training/engine/ranks.py numbers the global ranks by it)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now; a caller that binds it later must handle a lost race."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """True while some process listens on `port`, on any address: binding it is refused."""
    with socket.socket() as s:
        # Connections of a launch that just ended linger in TIME_WAIT; they do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(proc: subprocess.Popen, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM `proc` and every process below it, then SIGKILL what is left.

    The whole tree, not just the process group: torchrun starts each rank in a session of its
    own, so a signal to the launcher's group alone would leave the ranks to torchrun's own
    (30 s) shutdown.
    """
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        _, tree = psutil.wait_procs(tree, timeout=grace_s if sig == signal.SIGTERM else 5)
        if not tree:
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
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
    if os.getppid() != (parent or os.getppid()) or os.getppid() == 1:
        os._exit(1)  # the parent died before prctl took effect


def exit_after_teardown() -> None:
    """End a rank that has finished and destroyed its process group, without the interpreter's
    finalization.

    Seen on a busy 2-core machine: a rank that had reported everything and called
    `end_training` died at exit with "terminate called without an active exception"
    (SIGABRT), the launch failed, and the task's retry trained again from the last checkpoint.
    Most likely the DDP module, which the Accelerator still holds, keeps the gloo process group
    alive after `destroy_process_group`, so its C++ worker threads are torn down with the
    interpreter, where pytorch/pytorch#179291 places the same abort. Leaving without that
    teardown avoids the abort whatever its exact cause. Every file a rank writes
    is closed or line-buffered, so nothing is lost by leaving here.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tied_to_parent(command: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`command`, started so that it receives `sig` when the process starting it dies."""
    return [sys.executable, "-m", "training.processes", "--die-with-parent",
            sig.name.removeprefix("SIG"),
            "--parent", str(os.getpid()), "--", *command]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Exec a command that dies with its parent.")
    parser.add_argument("--die-with-parent", required=True, help="signal name, e.g. TERM")
    parser.add_argument("--parent", type=int, help="expected parent pid")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    die_with_parent(signal.Signals[f"SIG{args.die_with_parent}"], args.parent)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
