"""The demo pair shipped with the SDK (exstill_sdk/data/demo, made by tools/train_demo_pair.py):
a small target LLM trained on Python source and a draft distilled from it, as card images, with
the target's tokenizer. ``run_demo`` runs the target on the host CPU (onnxruntime) and the draft
on a card (the built-in emulator unless a URL is given), and compares with the target alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from exstill_sdk.errors import ExstillError, UnknownModelError

DRAFT_TARGET = "demo-draft"
POSITIONS = 2048
THREADS = 1
"""Compute threads of the demo target and of the emulated card: one core each, as a card brings
its own silicon; the target alone gets the same one core, so the comparison is like for like."""
DEFAULT_PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'


def demo_dir() -> Path:
    path = Path(str(resources.files("exstill_sdk") / "data" / "demo"))
    if not (path / "target.img").exists():
        raise ExstillError(
            f"the demo pair is missing from {path}; reinstall exstill-sdk, or make it with "
            "python tools/train_demo_pair.py"
        )
    return path


def demo_tokenizer() -> Any:
    """The demo target's tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(demo_dir() / "tokenizer.json"))


def emulator_url() -> str:
    """The built-in emulator with the demo draft loaded."""
    return f"emu://?context={POSITIONS}&threads={THREADS}&image={demo_dir() / 'draft.img'}"


@dataclass
class DemoResult:
    prompt: str
    text: str
    new_tokens: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    identical: bool
    mean_acceptance_length: float
    acceptance_per_position: list[float]
    prefetch_hits: int
    rounds: int
    k_chosen: dict[int, int] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["speedup"] = round(self.speedup, 2)
        out["k_chosen"] = {str(k): v for k, v in sorted(self.k_chosen.items())}
        return out


def run_demo(
    prompt: str = DEFAULT_PROMPT,
    *,
    url: str | None = None,
    max_new_tokens: int = 200,
    k: int | Literal["adaptive"] = "adaptive",
    on_text: Callable[[str], None] | None = None,
) -> DemoResult:
    """Generate ``max_new_tokens`` greedily, speculatively then with the target alone.
    ``on_text`` receives the speculative text as the target accepts it."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.card import open_card
    from exstill_sdk.spec import SpeculativeDecoder

    data = demo_dir()
    tokenizer = demo_tokenizer()
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise ExstillError("the prompt is empty")
    target = OnnxTarget(data / "target.img", max_sequences=1, positions=POSITIONS, threads=THREADS)
    budget = min(max_new_tokens, POSITIONS - len(prompt_ids) - 16)
    card_url = url or emulator_url()
    with open_card(card_url) as card:
        if DRAFT_TARGET not in {t.name for t in card.info().targets}:
            raise UnknownModelError(
                f"the card at {url} has no {DRAFT_TARGET!r} image; flash it with: "
                f"exstill-flash {data / 'draft.img'} --url {url}"
            )
        decoder = SpeculativeDecoder(card, target, draft=DRAFT_TARGET, k=k, max_k=8)
        # Warm both models (onnxruntime's first runs are slow) so that neither timing below
        # pays for it; the figures then come from a fresh decoder.
        decoder.generate(prompt_ids, 8, stop_token_ids=[])
        decoder = SpeculativeDecoder(card, target, draft=DRAFT_TARGET, k=k, max_k=8)
        spec: list[int] = []
        shown = ""
        t0 = time.perf_counter()
        for token in decoder.stream(prompt_ids, budget, stop_token_ids=[]):
            spec.append(token)
            if on_text is not None:
                text = tokenizer.decode(spec)
                if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
                    on_text(text[len(shown) :])
                    shown = text
        spec_s = time.perf_counter() - t0
        metrics = decoder.metrics
    t0 = time.perf_counter()
    plain = target.greedy(prompt_ids, budget)
    plain_s = time.perf_counter() - t0
    drafts = max(1, metrics.num_drafts)
    return DemoResult(
        prompt=prompt,
        text=tokenizer.decode(spec),
        new_tokens=len(spec),
        plain_tokens_per_s=round(len(plain) / plain_s, 1),
        spec_tokens_per_s=round(len(spec) / spec_s, 1),
        identical=spec == plain,
        mean_acceptance_length=round(metrics.mean_acceptance_length, 3),
        acceptance_per_position=[round(n / drafts, 3) for n in metrics.num_accepted_tokens_per_pos],
        prefetch_hits=metrics.prefetch_hits,
        rounds=metrics.rounds,
        k_chosen=dict(metrics.k_chosen),
    )
