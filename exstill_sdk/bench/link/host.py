"""The host's own cost of one speculative round, against context length.

What the host does each round besides waiting (the decoder, the target adapter's bookkeeping,
the acceptance rule, building and parsing frames) must not grow with the context: a 16K-token
context must cost what a 100-token one does. Measured with the emulated card in its own process
and the ONNX target adapter, the host's time is the wall time of a generation less the time it
waits for the card and less the target's compute inside onnxruntime; the marginal cost of a
round is taken between a short and a long generation, so the one-time prefill cancels out.

Two rows. ``host``: the adapter runs with its compute taken out (its runner returns logits
without running the model), which leaves exactly the host's own work. ``host_beside_target``:
the tiny model really runs, on the same core; its attention over a 16K context (8 MB of KV a
round) evicts the host's working set from the core's caches, so the host's unchanged work runs
slower there. A target served on a GPU does not share the host core's caches.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.card import open_card
from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.harness.card_process import emulator_process, pinned, split_cores
from exstill_sdk.harness.synthetic import synthetic_image
from exstill_sdk.speculative import SpeculativeDecoder

SHORT_ROUNDS = 50


class _Compute:
    """The seconds a target spends inside onnxruntime (its runner's prefill), tallied; with
    ``run_model=False`` the runner returns zero logits of the right shape instead."""

    def __init__(self, target: OnnxTarget, run_model: bool = True) -> None:
        self.seconds = 0.0
        runner = target.runner
        vocab = target.vocab_size
        prefill = runner.prefill

        def without_model(row: int, tokens: np.ndarray, start: int, last: int) -> np.ndarray:
            return np.zeros((last, vocab), np.float32)

        model = prefill if run_model else without_model

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return model(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        runner.prefill = timed  # type: ignore[method-assign]


def _host_seconds(
    decoder: SpeculativeDecoder, compute: _Compute, prompt: list[int], rounds: int
) -> tuple[float, int]:
    """(host seconds, rounds) of one generation: its wall time less the time it waited for the
    card (the card's compute, the link and the framing of the round trip) and less the
    target's compute."""
    compute_before = compute.seconds
    m = decoder.generate(prompt, max_new_tokens=rounds).metrics
    return m.total_s - m.card_wait_s - (compute.seconds - compute_before), m.rounds


def run(
    contexts: tuple[int, ...] = (100, 4000, 16000),
    rounds: int = 400,
    k: int = 4,
    repeats: int = 5,
) -> dict[str, Any]:
    if not contexts or min(contexts) < 16 or rounds <= SHORT_ROUNDS or not 1 <= k <= 8:
        raise InvalidArgumentError(
            f"need contexts of 16+ tokens, more than {SHORT_ROUNDS} rounds and 1 <= k <= 8"
        )
    host_cpu, card_cpu = split_cores()
    positions = max(contexts) + (rounds + 1) * (k + 1) + 64
    rng = np.random.default_rng(0)
    cycle = rng.integers(0, 32000, 50).tolist()  # periodic: prompt lookup drafts every round
    prompts = {n: (cycle * (n // len(cycle) + 1))[:n] for n in contexts}
    ways = ("host", "host_beside_target")
    samples: dict[str, dict[int, list[float]]] = {w: {n: [] for n in contexts} for w in ways}
    with tempfile.TemporaryDirectory(prefix="exstill-bench-host-") as tmp:
        image = synthetic_image(Path(tmp), "1x64")
        targets = {w: OnnxTarget(image, positions=positions, threads=1) for w in ways}
        computes = {w: _Compute(targets[w], run_model=w != "host") for w in ways}
        with (
            emulator_process("--context", str(positions), "--threads", "1", cpu=card_cpu) as url,
            pinned(host_cpu),
            open_card(url) as card,
        ):
            decoders = {w: SpeculativeDecoder(card, targets[w], engine="lookup", k=k) for w in ways}
            for w in ways:  # warm up
                _host_seconds(decoders[w], computes[w], prompts[min(contexts)], SHORT_ROUNDS)
            for _ in range(repeats):
                for n in contexts:  # alternate what is compared
                    for w in ways:
                        d, c = decoders[w], computes[w]
                        short, short_rounds = _host_seconds(d, c, prompts[n], SHORT_ROUNDS)
                        long, long_rounds = _host_seconds(d, c, prompts[n], rounds)
                        per_round = (long - short) / (long_rounds - short_rounds) * 1e6
                        samples[w][n].append(per_round)
    shortest, longest = min(contexts), max(contexts)
    out: dict[str, Any] = {"k": k, "rounds": rounds, "repeats": repeats}
    for w in ways:
        medians = {n: statistics.median(v) for n, v in samples[w].items()}
        out[f"{w}_us_per_round"] = {str(n): round(medians[n], 2) for n in contexts}
        out[f"{w}_us_range"] = {
            str(n): [round(min(v), 2), round(max(v), 2)] for n, v in samples[w].items()
        }
        out[f"{w}_ratio_{longest}_to_{shortest}"] = round(medians[longest] / medians[shortest], 3)
    return {
        **out,
        "placement": "card in its own process"
        + (f" on cpu {card_cpu}, host on cpu {host_cpu}" if card_cpu is not None else ""),
        "measured": "wall time per round less the card wait (the card's compute, the link) and "
        "the target's compute",
    }
