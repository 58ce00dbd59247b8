"""Timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def best_of(repeats: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds of the fastest of ``repeats`` calls, the last call's result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        seconds, out = timed(fn, *args, **kwargs)
        best = min(best, seconds)
    return best, out


def against_plain(
    target: Any, decoder: Any, prompt: list[int], new_tokens: int
) -> tuple[float, Any]:
    """The target alone (``target.greedy``) on ``prompt``, then ``decoder`` right after it, so
    that a slow spell of the machine falls on both: (the speed-up, the decoder's result)."""
    plain, _ = timed(target.greedy, prompt, new_tokens)
    spec, result = timed(decoder.generate, prompt, new_tokens, stop_token_ids=[])
    return plain / spec, result
