"""Timing like a card: the emulated card in a process of its own, on a core of its own.

A card brings its own silicon. An in-process emulator (emu://) shares the interpreter and the
core with the host's loop and the target, so every drafted token would be billed to the target's
time; a fair figure runs ``exstill-emu`` in its own process pinned to one core and the host (with
its target) pinned to another. There the emulator polls its link (``exstill-emu --poll-ms``)
for ``POLL_MS`` after each reply, as a card's firmware does, instead of sleeping in the kernel:
on a shared machine a process woken from sleep can take hundreds of microseconds to run, which a
card, whose core does nothing else, never pays.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from exstill_sdk.errors import ExstillError

START_TIMEOUT_S = 60.0
POLL_MS = 50.0
"""How long a pinned emulator polls its link after a reply: longer than the demo pair's
verification (docs/benchmarks.md)."""


def split_cores() -> tuple[int | None, int | None]:
    """(the host's core, the card's core): the first two this process may run on, or
    (None, None) where there are not two (then nothing is pinned). Call it before pinning."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)


@contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run this process (threads started inside included) on ``cpu``; restored afterwards."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def emulator_process(*args: str, cpu: int | None = None) -> Iterator[str]:
    """``exstill-emu ARGS`` listening on a free loopback port, pinned to ``cpu``; yields its
    URL and stops it afterwards."""
    command = [sys.executable, "-m", "exstill_sdk.cli.emu", "--listen", "tcp://127.0.0.1:0"]
    if cpu is not None:  # a core of its own: poll the link as a card does
        command += ["--poll-ms", str(POLL_MS)]

    def place() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.PIPE,
            stderr=errors,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=place,  # only sets the child's CPU affinity
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            if not url.startswith("tcp://"):
                proc.wait(START_TIMEOUT_S)
                errors.seek(0)
                why = errors.read().strip().splitlines()
                raise ExstillError(
                    "the emulated card did not start: " + (why[-1] if why else "no output")
                )
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with suppress(OSError):
                if proc.stdout is not None:
                    proc.stdout.close()
