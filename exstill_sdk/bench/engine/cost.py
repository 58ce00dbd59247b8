"""Per-token cost of the card's transformer engine, against HF transformers on the same weights.

- ``us_per_token_1_stream``: one stream drafting K tokens a round and committing the whole draft
  plus a bonus token, as a fully accepted round does (each drafted token costs one forward
  step); median over rounds.
- ``us_per_token_12_streams``: twelve streams drafting together (one batched step per drafted
  position); wall time of a round divided by all the tokens it drafted, median over rounds.
- ``hf_eager_us_per_token``: the same weights in transformers (``attn_implementation="eager"``),
  one greedy decode step with its KV cache; median over steps.

Engine and transformers run in the same process, interleaved in blocks so that machine noise
hits both alike, with a short pause between blocks so that neither library's spinning worker
threads eat into the other's block; each uses its library's default CPU threads.
"""

from __future__ import annotations

import statistics
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = 64
POSITIONS = 1024
PAUSE = 0.05


def _pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _engine_rounds(engine: Any, streams: int, k: int, vocab: int) -> Iterator[float]:
    """Endless rounds of ``streams`` streams; yields seconds per drafted token of each."""
    from exstill_firmware.engines.base import Sampling

    rng = np.random.default_rng(0)
    states = [engine.open_state(POSITIONS, Sampling()) for _ in range(streams)]
    for s in states:
        s.extend(_pack(rng.integers(0, vocab, PROMPT).tolist()))
    try:
        while True:
            t0 = time.perf_counter()
            proposals = engine.propose_many([(s, k, b"") for s in states])
            dt = time.perf_counter() - t0
            yield dt / max(1, sum(len(p.tokens) // 4 for p in proposals))
            for s, p in zip(states, proposals, strict=True):
                s.extend(p.tokens + _pack([int(rng.integers(0, vocab))]))
                if s.length > POSITIONS - 4 * (k + 1):
                    s.truncate(PROMPT)
    finally:
        for s in states:
            s.close()


def _hf_steps(image: Any) -> Iterator[float]:
    """Endless greedy decode steps of the image's weights in transformers; seconds each."""
    import torch
    from transformers import DynamicCache

    from exstill_sdk.adapters.hf import cache_keyword
    from exstill_sdk.image.hf import to_hf_model

    model = to_hf_model(image, "eager")
    keyword = cache_keyword(model)
    rng = np.random.default_rng(0)
    prompt = torch.tensor([rng.integers(0, image.arch.vocab_size, PROMPT).tolist()])
    with torch.no_grad():
        while True:
            cache = DynamicCache()  # extended in place by every call
            out = model(prompt, use_cache=True, **{keyword: cache})
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(POSITIONS - PROMPT - 1):
                t0 = time.perf_counter()
                out = model(token, use_cache=True, **{keyword: cache})
                token = out.logits[:, -1:].argmax(-1)
                yield time.perf_counter() - t0


def _take(source: Iterator[float], n: int, into: list[float]) -> None:
    """n samples, after one more that is dropped (the first after a pause runs cold)."""
    next(source)
    for _ in range(n):
        into.append(next(source))


def run(
    image_path: str | None = None,
    *,
    synthetic: str | None = None,
    k: int = 8,
    rounds: int = 40,
    hf: bool = True,
    heads: Sequence[int] = (),
) -> dict[str, Any]:
    """Benchmark an image, or a synthetic Llama draft ``LAYERSxHIDDEN`` (vocab 32000); with
    ``heads``, the same weights with a frequency-ranked head of each size too (ids 0..N-1:
    the cost depends on the size only), interleaved with the whole head."""
    from exstill_firmware.engines.transformer import TransformerEngine

    from exstill_sdk.harness.synthetic import image_or_synthetic
    from exstill_sdk.image import open_image
    from exstill_sdk.image.head import cut_head

    with tempfile.TemporaryDirectory(prefix="exstill-bench-engine-") as tmp:
        path = image_or_synthetic(Path(tmp), image_path, synthetic, "an image")
        image = open_image(path, verify=True)
        arch = image.arch
        variants = {"": image}
        for size in heads:
            cut = cut_head(image, range(size), Path(tmp) / f"head-{size}.img")
            variants[f"@{size}"] = open_image(cut.path)
        sources: dict[str, Callable[[], Iterator[float]]] = {}
        for suffix, variant in variants.items():
            engine = TransformerEngine(variant, rows=13, positions=POSITIONS)  # 1 + 12 streams
            sources["one" + suffix] = partial(_engine_rounds, engine, 1, k, arch.vocab_size)
            sources["twelve" + suffix] = partial(_engine_rounds, engine, 12, k, arch.vocab_size)
        hf_error = None
        if hf:
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401
            except ImportError as exc:
                hf_error = str(exc)
            else:
                sources["hf"] = lambda: _hf_steps(image)
        iters = {name: make() for name, make in sources.items()}
        samples: dict[str, list[float]] = {name: [] for name in iters}
        per_block = {
            name: {"one": 6, "twelve": 3, "hf": 6 * k}[name.split("@")[0]] for name in iters
        }
        for name, it in iters.items():  # warm-up
            _take(it, per_block[name], [])
        blocks = max(1, rounds // per_block["one"])
        for _ in range(blocks):
            for name, it in iters.items():
                time.sleep(PAUSE)
                _take(it, per_block[name], samples[name])
        for it in iters.values():
            it.close()  # type: ignore[attr-defined]
        med = {name: statistics.median(v) for name, v in samples.items()}
        result: dict[str, Any] = {
            "image": image.target,
            "layers": arch.num_layers,
            "hidden": arch.hidden_size,
            "vocab": arch.vocab_size,
            "dtype": image.quant,
            "k": k,
            "us_per_token_1_stream": round(med["one"] * 1e6, 1),
            "us_per_token_12_streams": round(med["twelve"] * 1e6, 1),
        }
        if heads:
            result["heads"] = {
                str(size): {
                    "us_per_token_1_stream": round(med[f"one@{size}"] * 1e6, 1),
                    "us_per_token_12_streams": round(med[f"twelve@{size}"] * 1e6, 1),
                    "speedup_1_stream": round(med["one"] / med[f"one@{size}"], 2),
                    "speedup_12_streams": round(med["twelve"] / med[f"twelve@{size}"], 2),
                }
                for size in heads
            }
        if "hf" in med:
            result["hf_eager_us_per_token"] = round(med["hf"] * 1e6, 1)
            result["speedup_vs_hf_1_stream"] = round(med["hf"] / med["one"], 2)
            result["speedup_vs_hf_12_streams"] = round(med["hf"] / med["twelve"], 2)
        elif hf:
            result["hf_eager_us_per_token"] = None
            result["hf_unavailable"] = hf_error
        return result
