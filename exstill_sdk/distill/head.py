"""The draft's frequency-ranked output head (FR-Spec, ACL 2025): the tokens it may propose.

On a small draft the output projection is most of the work of a drafted token: a
49,152 x 576 head is 113 MB in float32, read once per token, against 56 MB for four layers.
Most of those rows are rarely the right answer, so the image keeps only the ``size`` tokens
the target writes most often (docs/image-format.md, ``head.ids``); the card's graph gives the
others probability zero. The target still verifies every token, so output is unchanged: a
token outside the head only ends that round's draft.

Frequencies are counted over the distillation data: every token of the prompts and answers,
plus the target's probability of each of its top-k candidates at every answer position (soft
counts reach tokens the sample has not written yet). Ties, and tokens never seen, go by
lower id first: a BPE vocabulary numbers its merges in the order its training text made
them, most frequent first. The special tokens (end of text, the chat template's markers) are
always kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from exstill_sdk.distill.data import Example

WHOLE_VOCABULARY_BELOW = 16384
"""A vocabulary this small keeps its whole head by default: little to save."""
DEFAULT_SIZE = 16384
"""The default head of a larger vocabulary (a third of SmolLM2's 49,152; docs/distilling.md
gives its coverage and the card's time per token at other sizes)."""


def default_size(vocab_size: int) -> int:
    """The head ``exstill distill`` packs unless told: 0 (the whole vocabulary) for a small
    vocabulary."""
    return 0 if vocab_size < WHOLE_VOCABULARY_BELOW else min(DEFAULT_SIZE, vocab_size)


def frequency_ranked(
    examples: Iterable[Example], vocab_size: int, size: int, always: Sequence[int] = ()
) -> list[int]:
    """The ``size`` most frequent token ids of ``examples``, most frequent first, with
    ``always`` among them."""
    counts = np.zeros(vocab_size, np.float64)
    for e in examples:
        np.add.at(counts, e.ids, 1.0)
        np.add.at(counts, e.top_ids.ravel(), np.exp(e.top_logp.astype(np.float64)).ravel())
    keep = [int(i) for i in dict.fromkeys(always) if 0 <= i < vocab_size][:size]
    counts[keep] = np.inf
    order = np.lexsort((np.arange(vocab_size), -counts))
    return [int(i) for i in order[:size]]


def coverage(examples: Iterable[Example], head: Sequence[int]) -> float:
    """The share of the examples' answer tokens that the head holds."""
    answers = [e.ids[e.start :] for e in examples]
    tokens = np.concatenate(answers) if answers else np.zeros(0, np.int64)
    return float(np.isin(tokens, np.asarray(head)).mean()) if len(tokens) else 0.0
