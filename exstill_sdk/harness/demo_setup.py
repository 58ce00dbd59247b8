"""What the benchmarks that load the demo pair with many users share: held-out prompts for U
users, the emulated demo card in its own process on its own core (this process pinned to the
other), and a demo target as an OnnxTarget warmed at every batch size."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from exstill_sdk.demo import POSITIONS, THREADS, emulator_args, held_out_prompts
from exstill_sdk.harness.card_process import emulator_process, pinned, split_cores


def user_prompts(users: int, prompt_tokens: int) -> list[list[int]]:
    """``users`` held-out prompts of ``prompt_tokens`` tokens, repeated when there are fewer."""
    prompts = held_out_prompts(users, prompt_tokens)
    return [prompts[i % len(prompts)] for i in range(users)]


@contextmanager
def demo_card(users: int, prompt_tokens: int = 96) -> Iterator[tuple[Any, list[list[int]]]]:
    """The emulated demo card in its own process on one core, this process pinned to the
    other; and ``user_prompts(users, prompt_tokens)``."""
    from exstill_sdk.card import open_card

    with demo_cards(1, users, prompt_tokens) as (url, prompts), open_card(url) as card:
        yield card, prompts


@contextmanager
def demo_cards(
    cards: int, users: int, prompt_tokens: int = 96
) -> Iterator[tuple[str, list[list[int]]]]:
    """``cards`` emulated demo cards served by one process on one core (``exstill-emu
    --cards``), this process pinned to the other: their pool URL (one card's URL for one); and
    ``user_prompts(users, prompt_tokens)``."""
    host_cpu, card_cpu = split_cores()
    args = (*emulator_args(), "--cards", str(cards))
    with pinned(host_cpu), emulator_process(*args, cpu=card_cpu) as url:
        yield url, user_prompts(users, prompt_tokens)


def demo_onnx_target(image: Any, users: Sequence[int], prompts: list[list[int]]) -> Any:
    """A demo target's image as an OnnxTarget for up to ``max(users)`` sequences, warmed at
    every batch size of ``users`` (onnxruntime's first runs of a shape are slow)."""
    from exstill_sdk.adapters.onnx import OnnxTarget

    target = OnnxTarget(image, max_sequences=max(users), positions=POSITIONS, threads=THREADS)
    for u in sorted(set(users)):
        target.greedy_batch(prompts[:u], 2)
    return target
