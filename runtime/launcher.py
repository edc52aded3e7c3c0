"""Running `accelerate launch` as a child process group that is watched and always cleaned up.

Plain Python (no Prefect) so that it can be tested and reused alone; tasks/train.py wires it
to the Prefect log, artifacts and retries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue

from runtime.credentials import SECRET_VARIABLES
from training.config import TrainingSpec
from training.engine.events import Event, Failed, Preempted, last_from_rank_0
from training.engine.progress import TASK_REPORTS, ProgressReader
from training.hardware import cuda_gpu_count
from training.processes import (
    MACHINE_RANK,
    TERMINATE_GRACE_S,
    free_port,
    kill_tree,
    port_in_use,
    tied_to_parent,
)

STARTUP_TIMEOUT_S = 180.0

PORT_ATTEMPTS = 3


class LaunchFailed(RuntimeError):
    """A rank failed; the message names the rank and its error in one line, and `traceback` holds
    that rank's own traceback (logged once by `launch`)."""

    def __init__(self, message: str, traceback: str | None = None):
        super().__init__(message)
        self.traceback = traceback


class LaunchHung(LaunchFailed):
    """No rank made progress for `hang_timeout_s`."""


class LaunchTimedOut(LaunchFailed):
    pass


class LaunchPreempted(LaunchFailed):
    """The ranks stopped for a SIGTERM and saved where they were: a retry resumes there."""


class PortTaken(LaunchFailed):
    """The rendezvous port was taken between choosing it and binding it."""


def cuda_available() -> bool:
    return cuda_gpu_count() > 0  # without importing torch on a machine with no GPU driver


def launch_command(spec: TrainingSpec, module: str, args: list[str], port: int | None = None,
                   env: dict[str, str] | None = None) -> list[str]:
    """The `accelerate launch` command line for this spec."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if spec.accelerate_config_file:
        command += ["--config_file", spec.accelerate_config_file]
    else:
        per_machine = spec.resolved_num_processes()
        total = per_machine * spec.num_machines
        if total > 1:
            command += ["--multi_gpu"]
        command += ["--num_processes", str(total), "--num_machines", str(spec.num_machines),
                    "--mixed_precision", spec.mixed_precision, "--dynamo_backend", "no",
                    "--num_cpu_threads_per_process",
                    str(threads_per_process(per_machine, env))]
        if spec.num_machines > 1:
            command += multi_machine_options(spec)
        if spec.max_restarts:
            command += ["--max_restarts", str(spec.max_restarts)]
        command += ["--main_process_port", str(spec.main_process_port or port or free_port())]
    return command + ["-m", module, *args]


def multi_machine_options(spec: TrainingSpec) -> list[str]:
    """torchrun's c10d rendezvous at machine 0, which hosts its store.

    `is_host` is said, not guessed: torch guesses it by resolving the host name, which fails
    where a machine's name does not resolve to the address the others reach it at.
    """
    if not spec.main_process_ip:
        raise ValueError("a launch on several machines needs training.main_process_ip, the "
                         "address of machine 0 (the train task finds it when left unset)")
    conf = f"is_host={int(spec.machine_rank == 0)},join_timeout={spec.rendezvous_timeout_s:.0f}"
    return ["--machine_rank", str(spec.machine_rank), "--main_process_ip", spec.main_process_ip,
            "--rdzv_backend", "c10d", "--rdzv_conf", conf]


def threads_per_process(processes: int, env: dict[str, str] | None = None) -> int:
    """This machine's cores shared out among its ranks, unless OMP_NUM_THREADS (threads per
    process, in the launch's environment: a sweep trial's share, say) says otherwise.

    Left to itself, `accelerate launch` sets OMP_NUM_THREADS=1, so a single process on a CPU
    machine trains on one core and leaves the others idle.
    """
    given = (env if env is not None else os.environ).get("OMP_NUM_THREADS", "")
    if given.isdigit():
        return max(1, int(given))
    return max(1, len(os.sched_getaffinity(0)) // processes)


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # The task logs each epoch from rank 0's events: the rank need not print it too.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", TASK_REPORTS: "1",
           **(extra or {})}
    for name in SECRET_VARIABLES:  # the ranks talk to no store: they need no credentials
        env.pop(name, None)
    if not cuda_available():
        # Without it, `--multi_gpu` on a CPU-only host starts N processes that each train
        # alone as a world of one.
        env["ACCELERATE_USE_CPU"] = "1"
    elif env.get("TRAINFLOW_FORCE_CPU") != "1":
        # An ACCELERATE_USE_CPU exported for CPU runs (a shell profile, a pod spec) would make
        # a GPU host train on the CPU over gloo; only TRAINFLOW_FORCE_CPU=1 asks for that.
        env.pop("ACCELERATE_USE_CPU", None)
    # Make `training` importable in the ranks wherever the launch is started from.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@dataclass
class LaunchWatch:
    """What the caller hears about while the launch runs."""

    on_line: Callable[[str], None] = lambda line: None
    on_event: Callable[[Event], None] = lambda event: None
    on_started: Callable[[], None] = lambda: None  # the launch's process exists
    hang_timeout_s: float = 300.0
    # Interpreter, torch and rendezvous start-up report nothing; a busy machine can take a
    # while, so the hang clock is this generous until the first progress event arrives.
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    timeout_s: float | None = None
    events: list[Event] = field(default_factory=list)
    # Called while the launch runs; what it raises stops the launch (another machine failed).
    check: Callable[[], None] = lambda: None


@dataclass
class Watchdog:
    """The hang and timeout clocks of a launch, on one machine or several.

    Every progress event restarts the hang clock; until the first one, start-up (interpreters,
    torch, rendezvous) is allowed `startup_timeout_s` when that is longer.
    """

    hang_timeout_s: float
    startup_timeout_s: float
    timeout_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    progressed: bool = False

    def progress(self) -> None:
        self.progressed, self.last_progress = True, time.monotonic()

    def check(self, describe: Callable[[], str]) -> None:
        """Raise LaunchTimedOut or LaunchHung when a clock ran out; `describe` says where."""
        now = time.monotonic()
        if self.timeout_s and now - self.started > self.timeout_s:
            raise LaunchTimedOut(f"the launch ran past its {self.timeout_s:g} s timeout and "
                                 f"was stopped; {describe()}")
        allowed = (self.hang_timeout_s if self.progressed
                   else max(self.hang_timeout_s, self.startup_timeout_s))
        if now - self.last_progress > allowed:
            raise LaunchHung(f"no rank made progress for {allowed:g} s: the run is hung and "
                             f"was stopped; {describe()}")


def run_launch(command: list[str], env: dict[str, str], output_dir: Path, watch: LaunchWatch,
               cwd: Path | None = None, grace_s: float = TERMINATE_GRACE_S) -> list[Event]:
    """Run the launch to the end; on failure, hang, timeout or interruption kill its group.

    A launch that failed before any rank reported, while another process listens on its
    rendezvous port, lost that port: PortTaken. Ranks that stopped for a SIGTERM after saving
    are LaunchPreempted. When this process is stopped, the ranks get `grace_s` to save.
    """
    reader = ProgressReader(output_dir)
    reader.skip_existing()
    lines: Queue[str | None] = Queue()
    proc = subprocess.Popen(tied_to_parent(command), env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True, bufsize=1)
    # A dying rank and torchrun print tracebacks; a rank that reported its error carries it in
    # its `error` event, which the failure shows once. So from the first traceback on, the
    # output waits for the end: dropped then if a rank reported the failure, else logged.
    held: list[str] = []
    stopped_from_outside = False

    def on_line(line: str) -> None:
        if held or line.split("]: ", 1)[-1].startswith("Traceback (most recent call last)"):
            held.append(line)
        else:
            watch.on_line(line)

    pump = threading.Thread(target=_pump, args=(proc, lines), daemon=True)
    pump.start()
    dog = Watchdog(watch.hang_timeout_s, watch.startup_timeout_s, watch.timeout_s)
    last_seen: dict[int, Event] = {}
    try:
        watch.on_started()  # inside: whatever it raises, the launch is not left running
        while True:
            _drain(lines, on_line)
            for event in reader.poll():
                watch.events.append(event)
                last_seen[event.rank] = event
                dog.progress()
                watch.on_event(event)
            if proc.poll() is not None:
                break
            dog.check(lambda: describe(last_seen))
            watch.check()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)  # wakes at once when the launch exits
        pump.join(timeout=5)
        _drain(lines, on_line)
        for event in reader.poll():
            watch.events.append(event)
            watch.on_event(event)
        if stop := last_from_rank_0(watch.events, Preempted):
            raise LaunchPreempted(f"preempted in epoch {stop.epoch} after batch {stop.batches} "
                                  f"(optimizer step {stop.optimizer_steps}), saved in "
                                  f"{stop.checkpoint}: a retry resumes from there")
        if proc.returncode != 0:
            port = rendezvous_port(command)
            if port is not None and not watch.events and port_in_use(port):
                raise PortTaken(f"the rendezvous port {port} was taken by another process")
            raise LaunchFailed(*failure(proc.returncode, watch.events))
        return watch.events
    except BaseException as e:
        # Stopped from outside (a signal to this process, a cancellation, Ctrl-C), not by the
        # launch's own failure: the ranks get their grace to save where they are.
        stopped_from_outside = not isinstance(e, Exception)
        raise
    finally:
        kill_tree(proc, grace_s if stopped_from_outside else TERMINATE_GRACE_S)
        reported = proc.returncode not in (None, 0) and (
            rank_errors(watch.events) or last_from_rank_0(watch.events, Preempted))
        for line in held if not reported else ():
            watch.on_line(line)


def launch(spec: TrainingSpec, module: str, args: list[str], output_dir: Path,
           logger: logging.Logger | logging.LoggerAdapter, on_event: Callable[[Event], None],
           extra_env: dict[str, str] | None = None, one_process: bool = False,
           on_started: Callable[[], None] = lambda: None,
           check: Callable[[], None] = lambda: None) -> list[Event]:
    """`accelerate launch -m module args` for `spec`, watched; returns every rank's events.

    `one_process` runs `python -m module args` instead, for jobs too small to repay the
    launcher's and a second rank's start-up; Accelerator() then sees a world of one.

    A free port is chosen just before the launch, so another launch can take it first: then
    (and only for a port we chose) the launch is repeated on a new port.
    """
    if spec.num_machines > 1 and not one_process:
        extra_env = {**(extra_env or {}), MACHINE_RANK: str(spec.machine_rank)}
    for attempt in range(1, PORT_ATTEMPTS + 1):
        env = launch_env(extra_env)
        command = ([sys.executable, "-m", module, *args] if one_process
                   else launch_command(spec, module, args, port=free_port(), env=env))
        logger.info("launching: %s", " ".join(command))
        watch = LaunchWatch(on_line=lambda line: logger.info("%s", line), on_event=on_event,
                            on_started=on_started, hang_timeout_s=spec.hang_timeout_s,
                            timeout_s=spec.timeout_s, check=check)
        try:
            return run_launch(command, env, output_dir, watch,
                              grace_s=max(TERMINATE_GRACE_S, spec.preemption_grace_s))
        except PortTaken:
            if spec.main_process_port or spec.num_machines > 1 or attempt == PORT_ATTEMPTS:
                raise
            logger.warning("rendezvous port taken by another process; launching again")
        except LaunchFailed as failed:
            if failed.traceback:  # the one place it is shown
                logger.error("%s\n%s", failed, failed.traceback.rstrip())
            raise
    raise AssertionError("unreachable")


def rendezvous_port(command: list[str]) -> int | None:
    """The port the launch's store listens on, if the command names one."""
    if "--main_process_port" not in command:
        return None
    return int(command[command.index("--main_process_port") + 1])


def _pump(proc: subprocess.Popen, lines: Queue) -> None:
    for line in proc.stdout:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _drain(lines: Queue, on_line: Callable[[str], None]) -> None:
    while True:
        try:
            line = lines.get_nowait()
        except Empty:
            return
        if line is not None:
            on_line(line)


def describe(last_seen: dict[int, Event]) -> str:
    if not last_seen:
        return "no rank reported any progress yet"
    parts = []
    for rank, event in sorted(last_seen.items()):
        where = ", ".join(f"{k} {getattr(event, k)}" for k in ("phase", "epoch", "step")
                          if getattr(event, k, None) is not None)
        ago = time.time() - event.time
        parts.append(f"rank {rank} last {event.event} ({where}) {ago:.0f} s ago")
    return "last progress: " + "; ".join(parts)


def rank_errors(events: list[Event]) -> list[Failed]:
    return sorted((e for e in events if isinstance(e, Failed)), key=lambda e: e.time)


def failure(returncode: int, events: list[Event]) -> tuple[str, str | None]:
    """One line naming the rank that failed first and its error, and that rank's traceback."""
    errors = rank_errors(events)
    if not errors:
        return (f"accelerate launch exited with code {returncode} and no rank reported an error "
                "(killed from outside, or it failed before training started; see the log above)",
                None)
    first = errors[0]
    others = sorted({e.rank for e in errors} - {first.rank})
    also = f" (ranks {others} failed after it)" if others else ""
    return f"rank {first.rank} failed{also}: {first.error}", first.traceback
