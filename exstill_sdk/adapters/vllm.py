"""vLLM adapter: the card drafts for vLLM's speculative decoding.

Use it as vLLM's custom proposer::

    LLM(model=..., speculative_config={
        "method": "custom_class",
        "model": "exstill_sdk.adapters.vllm.ExstillProposer",
        "num_speculative_tokens": 4,
    })

The card is found by, in this order: ``additional_config={"exstill": {"url": ..., "draft": ...}}``
in vLLM's config, then the environment variables ``EXSTILL_CARD_URL`` and ``EXSTILL_DRAFT``.
``url`` defaults to the built-in emulator (``emu://``, prompt lookup); several URLs separated by
commas are a pool of cards served as one (exstill_sdk.pool); ``draft`` names a target
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
Under tensor (and pipeline) parallelism vLLM builds the proposer in every rank of the last
pipeline stage; only the output rank (tensor-parallel rank 0 there) talks to the card, the other
ranks return empty drafts, which vLLM drops (it takes the output rank's drafts and schedules them
for every rank). A card's streams are then one per request, whatever the parallelism.

vLLM is not a dependency of exstill-sdk: this module imports nothing from it but, where vLLM is
present, its parallel state (to know the output rank).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exstill_sdk.adapters.rows import RowStreams
from exstill_sdk.errors import InvalidArgumentError, TokenizerMismatchError, UnknownModelError
from exstill_sdk.interface import CardInterface
from exstill_sdk.pool import open_cards

URL_ENV = "EXSTILL_CARD_URL"
DRAFT_ENV = "EXSTILL_DRAFT"
K_ENV = "EXSTILL_K"
LOOKUP_ENV = "EXSTILL_LOOKUP"
MODEL_K_ENV = "EXSTILL_MODEL_K"
METRICS_ENV = "EXSTILL_METRICS_LISTEN"
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


def choose_draft(card: CardInterface, draft: str | None, vocab_size: int) -> str | None:
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


def is_output_rank() -> bool:
    """Whether this process is the rank whose drafts vLLM uses: tensor-parallel rank 0 of the
    last pipeline stage. vLLM builds the proposer in every tensor-parallel rank and calls
    ``propose`` in each, but takes the drafts of that rank alone and schedules them for every
    rank; outside vLLM's distributed setup (no groups), the one process is that rank."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return bool(get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank)
    except (ImportError, AssertionError):
        return True


class ExstillProposer:
    """vLLM's ``custom_class`` proposer backed by a card (see the module's docstring)."""

    _metrics_server: Any = None
    """The process's EXSTILL_METRICS_LISTEN server, started once."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.settings = card_settings(vllm_config)
        self.card: CardInterface | None = None
        self.rows: RowStreams | None = None
        self._collectors: list[Any] = []
        self._mirror: Any = None
        self.output_rank: bool | None = None
        """Whether this process's drafts are the ones vLLM uses (known at load_model)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM calls this once the target is loaded: connect to the card, on the output rank
        only (``is_output_rank``)."""
        if self.output_rank is None:
            self.output_rank = is_output_rank()
        if self.card is None and self.output_rank:
            self.card = open_cards(self.settings.url)
            draft = choose_draft(self.card, self.settings.draft, self.vocab_size)
            self.rows = RowStreams(
                self.card,
                draft=draft,
                engine=None if draft else "lookup",
                adaptive=self.settings.adaptive,
                lookup=self.settings.lookup and draft is not None,
                model_k=self.settings.model_k,
            )
            self._export_metrics()

    def _export_metrics(self) -> None:
        """The rows' counts (and a pool's placement) in prometheus_client's default registry,
        which a process serving /metrics with it exports. vLLM v1 runs the proposer in its
        engine's worker: with PROMETHEUS_MULTIPROC_DIR set they are copied every second for
        vLLM's own /metrics (metrics/multiprocess.py), and with
        EXSTILL_METRICS_LISTEN=HOST:PORT served from this process."""
        from prometheus_client import REGISTRY, start_http_server

        from exstill_sdk.metrics.multiprocess import MultiprocessMirror, multiprocess_mode
        from exstill_sdk.metrics.prometheus import PoolCollector, RowsCollector
        from exstill_sdk.pool import CardPool

        assert self.rows is not None
        self._collectors = [RowsCollector(self.rows)]
        if isinstance(self.card, CardPool):
            self._collectors.append(PoolCollector(self.card))
        for collector in self._collectors:
            REGISTRY.register(collector)
        if multiprocess_mode():  # vLLM's own /metrics reads this process's metrics
            self._mirror = MultiprocessMirror(self._collectors)
            self._mirror.start()
        listen = os.environ.get(METRICS_ENV)
        if listen and ExstillProposer._metrics_server is None:
            host, _, port = listen.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgumentError(f"{METRICS_ENV} wants HOST:PORT, not {listen!r}")
            ExstillProposer._metrics_server = start_http_server(int(port), host)

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """One draft list per row of vLLM's batch (empty for rows still in prefill). On a rank
        other than the output rank, every row's list is empty and the card is not asked: vLLM
        drops those drafts, so the ranks cannot disagree and the card's streams are one per
        request."""
        if self.rows is None:
            self.load_model()
        if not self.output_rank:
            return [[] for _ in sampled_token_ids]
        assert self.rows is not None
        return self.rows.propose(
            sampled_token_ids, num_tokens_no_spec, token_ids_cpu, self.k, self.max_model_len
        )

    def close(self) -> None:
        """Close the streams and the link. vLLM never calls it: when its worker exits the link
        drops, and the card frees the streams of a dropped link."""
        from prometheus_client import REGISTRY

        if self._mirror is not None:
            self._mirror.stop()
            self._mirror = None
        for collector in self._collectors:
            REGISTRY.unregister(collector)
        self._collectors = []
        if self.rows is not None:
            self.rows.close()
        if self.card is not None:
            self.card.close()
        self.card = self.rows = None
