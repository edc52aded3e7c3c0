"""What one machine must know about the network before it joins a multi-machine launch.

Plain Python (no Prefect): the address the other machines reach this one at, the interface
it is on, and quick, clear checks that replace torch's minutes-long rendezvous timeouts.
"""

from __future__ import annotations

import errno
import os
import socket
import time

import psutil

# Fail at once on these: waiting will not make machine 0 appear.
UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}


class NetworkProblem(RuntimeError):
    """A machine cannot take part; the message says which and what to change."""


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`: where machines on that network reach it.

    A UDP `connect` sends nothing; it only asks the kernel which route and source it would use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(host), 9))
        except OSError as e:
            raise NetworkProblem(f"this machine has no route to {host}: {e}") from None
        return probe.getsockname()[0]


def local_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for every interface of this machine."""
    return {a.address: name for name, addrs in psutil.net_if_addrs().items()
            for a in addrs if a.family == socket.AF_INET}


def rendezvous_env(address: str) -> dict[str, str]:
    """Make torch use `address` (not whatever the host name resolves to) for this machine.

    PET_LOCAL_ADDR is torchrun's `--local_addr`, which `accelerate launch` does not pass on;
    gloo and NCCL pick their interface by name.
    """
    env = {"PET_LOCAL_ADDR": address}
    interface = local_addresses().get(address)
    if interface and not address.startswith("127."):
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = interface
    return env


def check_main_address(address: str, port: int) -> None:
    """On machine 0: `address` is one of its own and `port` is free there."""
    if address not in local_addresses():
        raise NetworkProblem(
            f"training.main_process_ip {address} is not an address of machine 0, which has "
            f"{', '.join(sorted(local_addresses()))}; leave it unset to have it found")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            raise NetworkProblem(
                f"port {port} on machine 0 ({address}) is taken ({e.strerror}); set "
                "training.main_process_port to a free port, or leave it unset") from None


def wait_reachable(address: str, port: int, timeout_s: float) -> None:
    """On machines 1..N-1: wait until machine 0's rendezvous port answers.

    Refused means machine 0 has not started listening yet: try again until `timeout_s`.
    No route means it never will.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=3):
                return
        except OSError as e:
            problem = e
            if e.errno in UNREACHABLE:
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    raise NetworkProblem(
        f"machine 0 at {address}:{port} cannot be reached from this machine within "
        f"{timeout_s:g} s: {problem}. The machines must share a network with that port open between them; "
        "training.main_process_ip, when set, must be machine 0's address on it")
