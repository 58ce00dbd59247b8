"""What each kind of draft would have proposed along the target's own continuation.

- A draft model (a card image, run as the transformers model of its weights, or by
  onnxruntime as the card runs it): one teacher-forced pass over prompt + continuation gives,
  at every position, the rank of the target's token among the draft's predictions; rank 0 is
  an accepted token (acceptance.py explains why one pass serves every chain).
- Prompt lookup (the card's own ``lookup`` engine, firmware/engines/lookup.py): the chain it
  proposes at each position from the text so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from exstill_firmware.engines.base import Sampling
from exstill_firmware.engines.lookup import LookupEngine

from exstill_sdk.protocol.messages import decode_tokens, encode_tokens

LOOKUP = "prompt lookup"


def target_ranks(logits: np.ndarray, continuation: list[int]) -> np.ndarray:
    """For each continuation token, its rank under a model's ``logits`` for it ([len(continuation),
    vocab]: ``target.continuation_logits``, or the card's draft run by onnxruntime): the count
    of tokens scored strictly higher."""
    chosen = logits[np.arange(len(continuation)), continuation]
    return (logits > chosen[:, None]).sum(axis=1).astype(np.int64)


def draft_ranks(draft: Any, prompt: Sequence[int], text: Sequence[int]) -> np.ndarray:
    """``target_ranks`` of ``text`` after ``prompt`` under ``draft`` (a target adapter running
    the card's draft image, such as ``OnnxTarget``): one teacher-forced pass, its sequence 0
    released after."""
    try:
        logits = draft.verify(0, prompt, text[:-1])  # row i scores text[i]
    finally:
        draft.release(0)
    return target_ranks(logits, list(text))


def lookup_chains(prompt: list[int], continuation: list[int], max_k: int) -> list[list[int]]:
    """The chain of up to ``max_k`` tokens prompt lookup proposes before each continuation
    token, given the text up to it."""
    state = LookupEngine().open_state(len(prompt) + len(continuation) + max_k, Sampling())
    state.extend(encode_tokens(prompt))
    chains = []
    for token in continuation:
        chains.append(list(decode_tokens(state.propose(max_k).tokens)))
        state.extend(encode_tokens([token]))
    return chains
