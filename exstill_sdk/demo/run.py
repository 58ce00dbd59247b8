"""``run_demo``: the demo target on this CPU (onnxruntime, one core), its draft on a card (an
emulated card in its own process on another core unless a URL is given), speculative decoding
timed against the target alone, and what bounds the result on this machine."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from exstill_sdk.demo.pair import (
    DRAFT_TARGET,
    POSITIONS,
    THREADS,
    demo_dir,
    demo_tokenizer,
    draft_model,
    emulator_args,
)
from exstill_sdk.demo.targets import DemoTarget, demo_target
from exstill_sdk.errors import ExstillError, InvalidArgumentError, UnknownModelError
from exstill_sdk.harness.card_process import emulator_process, pinned, split_cores
from exstill_sdk.harness.speedup import SpeedupRun, measure_speedup
from exstill_sdk.protocol.constants import Features
from exstill_sdk.support.prefetch import prefetch_report

DEFAULT_PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'
"""A prompt after which the demo target writes varied text: after others (``def
read_config(path):``, for one) a 4.2M model soon repeats one line, which any draft keeps whole
and which would make the speed-up that of a copying machine."""
MAX_K = 8
DEFAULT_RUNS = {"large": 3, "small": 21, "smollm2": 3}


@dataclass(frozen=True)
class DemoPair:
    """What a demo runs: a target, the draft image its card serves, and its text."""

    target: DemoTarget
    draft: Path
    draft_name: str
    """The target name the draft's streams open."""
    encode: Callable[[str], list[int]]
    """The prompt's ids (for a chat model, the user's turn)."""
    decode: Callable[[list[int]], str]
    end_ids: frozenset[int] = frozenset()
    """The text shown stops at the first of these (a chat model's end of turn)."""

    def shown(self, tokens: list[int]) -> list[int]:
        for i, token in enumerate(tokens):
            if token in self.end_ids:
                return tokens[:i]
        return tokens


def default_prompt(target: str) -> str:
    if target == "smollm2":
        from exstill_sdk.demo.smollm2 import PROMPT

        return PROMPT
    return DEFAULT_PROMPT


def demo_pair(
    target: str,
    draft: str | Path | None = None,
    *,
    progress: bool = False,
    on_stage: Callable[[str], None] | None = None,
) -> DemoPair:
    """The shipped pair with the ``large`` or ``small`` target, or SmolLM2 (``smollm2``) with
    ``draft`` (default: demo/smollm2.py's ``draft_path``)."""
    if target == "smollm2":
        import exstill_sdk.demo.smollm2 as smollm2
        from exstill_sdk.evaluation.prompts import Prompt
        from exstill_sdk.evaluation.target import encode

        where = smollm2.draft_file(draft)  # before the minutes of packing on first use
        tokenizer = smollm2.chat_tokenizer()
        chosen = smollm2.smollm2_target(on_stage=on_stage)
        image = smollm2.smollm2_draft(where, chosen.image)
        return DemoPair(
            chosen,
            Path(image.path or ""),
            image.target,
            lambda text: encode(tokenizer, Prompt("demo", text)),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            frozenset(chosen.image.tokenizer.special_ids.get("eos", ())),
        )
    if draft is not None:
        raise InvalidArgumentError(
            "--draft is for --target smollm2: the shipped pair has its own draft"
        )
    tokenizer = demo_tokenizer()
    return DemoPair(
        demo_target(target, progress=progress, on_stage=on_stage),
        demo_dir() / "draft.img",
        DRAFT_TARGET,
        lambda text: list(tokenizer.encode(text).ids),
        tokenizer.decode,
    )


@dataclass
class DemoResult:
    prompt: str
    text: str
    target: DemoTarget
    card: str
    placement: str
    run: SpeedupRun
    card_prefetch: dict[str, Any]
    """The card's prefetch counters over the runs (exstill_sdk.support.prefetch)."""

    @property
    def identical(self) -> bool:
        return self.run.identical

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "target": {
                "name": self.target.name,
                "image": self.target.image.target,
                "parameters": self.target.parameters,
                "weight_bytes": self.target.image.data_size,
                "what": self.target.description,
            },
            "card": self.card,
            "placement": self.placement,
            **self.run.to_dict(),
            "card_prefetch": self.card_prefetch,
        }


def missing_draft_advice(
    url: str | None, features: Features, image: Path | None = None, name: str = DRAFT_TARGET
) -> str:
    """What to do when the card at ``url`` lacks the demo's draft (``image``, for streams of
    ``name``): flash it where the card has an image store (with the admin key a network link
    needs), else serve an emulator with it."""
    image = image or demo_dir() / "draft.img"
    said = f"the card at {url} has no {name!r} image; "
    if not features & Features.IMAGE_STORE:
        return said + (
            "it has no image store to flash it to: serve an emulated card with it "
            f"(exstill-emu --image {image}) and pass that URL, or leave --url out"
        )
    key = " --key ADMIN_KEY_FILE" if url and url.startswith("tcp://") else ""
    return said + f"flash it with: exstill-flash {image} --url {url}{key}"


def run_demo(
    prompt: str | None = None,
    *,
    url: str | None = None,
    target: str = "large",
    draft: str | Path | None = None,
    max_new_tokens: int = 200,
    k: int | Literal["adaptive"] = "adaptive",
    trees: Literal["auto", "off"] = "off",
    runs: int | None = None,
    on_text: Callable[[str], None] | None = None,
    progress: bool = False,
    on_stage: Callable[[str], None] | None = None,
) -> DemoResult:
    """Generate ``max_new_tokens`` after ``prompt`` (default: ``default_prompt(target)``)
    greedily with the target alone and speculatively, ``runs``
    times each, alternating (default: 3 for the large target, 21 for the small one, whose runs
    last a tenth of a second each, too short for three to give a steady median on a shared
    machine). ``on_text`` receives the continuation as the target accepts it, in a first
    (untimed) speculative run; ``trees`` is the decoder's (``SpeculativeDecoder``);
    ``on_stage`` hears what is under way as it starts (the first
    use of the large target builds it: ``progress`` shows a bar then)."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.card import open_card
    from exstill_sdk.speculative import SpeculativeDecoder

    prompt = prompt if prompt is not None else default_prompt(target)
    runs = runs if runs is not None else DEFAULT_RUNS.get(target, 3)
    if runs < 1:
        raise ExstillError("runs must be at least 1")
    if not prompt:
        raise ExstillError("the prompt is empty")
    host_cpu, card_cpu = split_cores()
    stage = on_stage or (lambda _: None)
    with ExitStack() as stack:
        if url is not None:  # the user's card first: a wrong URL fails before any work
            stage(f"opening the card at {url}")
            card = stack.enter_context(open_card(url))
            placement = "card at " + url
            pair = demo_pair(target, draft, progress=progress, on_stage=on_stage)
        else:
            pair = demo_pair(target, draft, progress=progress, on_stage=on_stage)
            stage("starting the emulated card in a process of its own")
            card_url = stack.enter_context(
                emulator_process(*emulator_args(pair.draft), cpu=card_cpu)
            )
            card = stack.enter_context(open_card(card_url))
            placement = "emulated card in its own process" + (
                f" on cpu {card_cpu}, target on cpu {host_cpu}" if card_cpu is not None else ""
            )
        prompt_ids = pair.encode(prompt)
        budget = min(max_new_tokens, POSITIONS - len(prompt_ids) - MAX_K - 2)
        if budget < 1:
            raise ExstillError(f"the prompt leaves no room in the demo's {POSITIONS} positions")
        if pair.draft_name not in {t.name for t in card.info().targets}:
            raise UnknownModelError(
                missing_draft_advice(url, card.info().features, pair.draft, pair.draft_name)
            )
        chosen = pair.target
        stack.enter_context(pinned(host_cpu))
        stage(f"loading the target ({chosen.image.target}) into onnxruntime")
        model = OnnxTarget(chosen.image, max_sequences=1, positions=POSITIONS, threads=THREADS)

        decoder = SpeculativeDecoder(
            card, model, draft=pair.draft_name, k=k, max_k=MAX_K, trees=trees
        )

        shown = ""

        def show(tokens: list[int]) -> None:
            nonlocal shown
            if on_text is None:
                return
            text = pair.decode(pair.shown(tokens))
            if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
                on_text(text[len(shown) :])
                shown = text

        before = card.stats()
        run = measure_speedup(
            model,
            decoder,
            [prompt_ids],
            budget,
            draft=draft_model(pair.draft),
            runs=runs,
            on_token=show,
            on_stage=on_stage,
        )
        card_prefetch = prefetch_report(card.stats(), before)
    return DemoResult(
        prompt=prompt,
        text=pair.decode(pair.shown(run.tokens)),
        target=chosen,
        card=url or "emulator",
        placement=placement,
        run=run,
        card_prefetch=card_prefetch,
    )
