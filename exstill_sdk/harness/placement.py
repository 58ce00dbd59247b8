"""CPU placement for link benchmarks on one machine (Linux).

A request/response over loopback costs very different amounts depending on whether the two
processes share a core (a direct hand-off) or not (a cross-core wake-up, often 50 us or more
on a VM). A fair side-by-side therefore gives the baseline echo server exactly the placement of
the card server: the benchmark finds the process listening on the card's port and pins it and
the echo server to the same CPU, and itself to another ("cross-core": a card is separate
hardware) or to the same one ("same-core").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from exstill_sdk.errors import InvalidArgumentError

PLACEMENTS = ("cross-core", "same-core", "none")


def listening_pid(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port``, if /proc can tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _pin_process(pid: int, cpus: set[int]) -> dict[int, set[int]]:
    """Pin every thread of a process (affinity is per thread); the previous affinities."""
    before = {}
    for tid in _threads(pid):
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except OSError:
            continue
    return before


@contextmanager
def placed(placement: str, server_pid: int | None) -> Iterator[tuple[set[int] | None, str]]:
    """Pin this process and the card server; yields (cpus for the echo server, description).

    Restores both affinities afterwards. Falls back to "none" when pinning is impossible."""
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"placement must be one of {', '.join(PLACEMENTS)}")
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if placement == "none" or server_pid is None or not mine:
        why = "" if placement == "none" else " (card server process not found or no affinity API)"
        yield None, "none" + why
        return
    cpus = sorted(mine)
    if placement == "cross-core" and len(cpus) < 2:
        placement = "same-core"
    client_cpu = cpus[0]
    server_cpu = cpus[1] if placement == "cross-core" else cpus[0]
    server_before = _pin_process(server_pid, {server_cpu})
    try:
        os.sched_setaffinity(0, {client_cpu})
        yield {server_cpu}, f"{placement}: client on cpu {client_cpu}, servers on cpu {server_cpu}"
    finally:
        os.sched_setaffinity(0, mine)
        for tid, cpus_before in server_before.items():
            with suppress(OSError):  # the thread may have ended
                os.sched_setaffinity(tid, cpus_before)
