"""vLLM adapter: the card drafts for vLLM's speculative decoding.

Use it as vLLM's custom proposer::

    LLM(model=..., speculative_config={
        "method": "custom_class",
        "model": "exstill_sdk.adapters.vllm.ExstillProposer",
        "num_speculative_tokens": 4,
    })

The card is found by, in this order: ``additional_config={"exstill": {"url": ..., "draft": ...}}``
in vLLM's config, then the environment variables ``EXSTILL_CARD_URL`` and ``EXSTILL_DRAFT``.
``url`` defaults to the built-in emulator (``emu://``, prompt lookup); ``draft`` names a target
image on the card packed for the served model (``exstill-pack``), and defaults to the card's
only target image if it has exactly one, else to its prompt-lookup engine.

``num_speculative_tokens`` is what every row drafts (``"k": "fixed"``, the default). With
``"k": "adaptive"`` (or ``EXSTILL_K=adaptive``) each row drafts as many as pay for themselves, up
to it: K per row from the row's own acceptance and the measured cost of vLLM's step by the
tokens in it (RowStreams, BatchK). It is not the default because it measured slower than the
fixed K on the demo pair in vLLM (docs/benchmarks.md, "Side by side with vLLM", holds the
figures): vLLM's step, timed between two ``propose`` calls, is too coarse a clock for it.

With a draft image, rows draft by prompt lookup where their text repeats and by the draft
model elsewhere (``"lookup": true``, the default; ``"lookup": false`` or ``EXSTILL_LOOKUP=0``
for the model alone): firmware/engines/hybrid.py. A row whose last draft was the model's drafts
at most ``"model_k"`` tokens (default 2, ``EXSTILL_MODEL_K``; ``0`` for no cap), a lookup row
``num_speculative_tokens``: lookup's drafts cost the card nothing and are mostly right, the
model's later tokens seldom are, and in a pass bound by arithmetic each drafted token costs as
much as a plain one (docs/benchmarks.md has the measured effect of the cap).

vLLM verifies every drafted token with its own rejection sampler, so its output is what it would
be without speculation. vLLM does not tell a proposer which request a row of its batch holds;
``RowStreams`` (exstill_sdk.adapters.rows) keeps one card stream per row by content.
vLLM is not a dependency of exstill-sdk: this module imports nothing from it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exstill_sdk.adapters.rows import RowStreams
from exstill_sdk.card import Card, open_card
from exstill_sdk.errors import InvalidArgumentError, TokenizerMismatchError, UnknownModelError

URL_ENV = "EXSTILL_CARD_URL"
DRAFT_ENV = "EXSTILL_DRAFT"
K_ENV = "EXSTILL_K"
LOOKUP_ENV = "EXSTILL_LOOKUP"
MODEL_K_ENV = "EXSTILL_MODEL_K"
DEFAULT_MODEL_K = 2
DEFAULT_URL = "emu://"
K_CHOICES = ("adaptive", "fixed")


@dataclass(frozen=True)
class ProposerSettings:
    url: str
    draft: str | None
    """A target image on the card, or None for the default (module docstring)."""
    adaptive: bool
    """Each row's K chosen up to num_speculative_tokens (True), or always that K (False)."""
    lookup: bool = True
    """Prompt lookup in front of the draft model (True), or the model alone."""
    model_k: int | None = DEFAULT_MODEL_K
    """With lookup: the most tokens of a draft the model made (None: no cap)."""


def card_settings(vllm_config: Any) -> ProposerSettings:
    """The proposer's settings from vLLM's config, then the environment."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    ours = extra.get("exstill", {}) if isinstance(extra, dict) else {}
    url = ours.get("url") or os.environ.get(URL_ENV) or DEFAULT_URL
    draft = ours.get("draft") or os.environ.get(DRAFT_ENV) or None
    k = ours.get("k") or os.environ.get(K_ENV) or "fixed"
    if k not in K_CHOICES:
        raise InvalidArgumentError(
            f"the Exstill proposer's k is {k!r}: use one of {', '.join(K_CHOICES)} "
            f'(additional_config={{"exstill": {{"k": ...}}}} or {K_ENV})'
        )
    lookup = ours.get("lookup", os.environ.get(LOOKUP_ENV, "1"))
    if isinstance(lookup, str):
        if lookup.lower() not in ("0", "1", "true", "false"):
            raise InvalidArgumentError(
                f"the Exstill proposer's lookup is {lookup!r}: use true or false "
                f"(additional_config) or 1 or 0 ({LOOKUP_ENV})"
            )
        lookup = lookup.lower() in ("1", "true")
    given = ours.get("model_k", os.environ.get(MODEL_K_ENV, DEFAULT_MODEL_K))
    try:
        model_k = int(given)
    except (TypeError, ValueError):
        model_k = -1
    if model_k < 0:
        raise InvalidArgumentError(
            f"the Exstill proposer's model_k is {given!r}: a whole number, 0 for no cap "
            f"(additional_config or {MODEL_K_ENV})"
        )
    return ProposerSettings(url, draft, k == "adaptive", bool(lookup), model_k or None)


def choose_draft(card: Card, draft: str | None, vocab_size: int) -> str | None:
    """The target image to draft with (None: the card's prompt-lookup engine), checked against
    the served model's vocabulary."""
    targets = {t.name: t for t in card.info().targets}
    if draft is None:
        if len(targets) != 1:
            return None
        draft = next(iter(targets))
    info = targets.get(draft)
    if info is None:
        raise UnknownModelError(
            f"the card at {card.url} has no target {draft!r}; it has: "
            + (", ".join(sorted(targets)) or "none")
            + f". Flash one with exstill-flash, or set {DRAFT_ENV}"
        )
    if info.vocab_size != vocab_size:
        raise TokenizerMismatchError(
            f"the card's {draft!r} drafts over {info.vocab_size} tokens, the served model has "
            f"{vocab_size}: pack the draft with the served model's tokenizer"
        )
    return draft


class ExstillProposer:
    """vLLM's ``custom_class`` proposer backed by a card (see the module's docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.settings = card_settings(vllm_config)
        self.card: Card | None = None
        self.rows: RowStreams | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM calls this once the target is loaded: connect to the card."""
        if self.card is None:
            self.card = open_card(self.settings.url)
            draft = choose_draft(self.card, self.settings.draft, self.vocab_size)
            self.rows = RowStreams(
                self.card,
                draft=draft,
                engine=None if draft else "lookup",
                adaptive=self.settings.adaptive,
                lookup=self.settings.lookup and draft is not None,
                model_k=self.settings.model_k,
            )

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """One draft list per row of vLLM's batch (empty for rows still in prefill)."""
        if self.rows is None:
            self.load_model()
        assert self.rows is not None
        return self.rows.propose(
            sampled_token_ids, num_tokens_no_spec, token_ids_cpu, self.k, self.max_model_len
        )

    def close(self) -> None:
        """Close the streams and the link. vLLM never calls it: when its worker exits the link
        drops, and the card frees the streams of a dropped link."""
        if self.rows is not None:
            self.rows.close()
        if self.card is not None:
            self.card.close()
        self.card = self.rows = None
