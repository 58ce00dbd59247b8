"""The target's sampling distribution p, shaped exactly as plain sampling shapes it
(exstill_sdk.support.sampling: the same shaping the card uses for its drafts), and drawing
from it."""

from __future__ import annotations

import numpy as np

from exstill_sdk.support.sampling import SamplingParams
from exstill_sdk.support.sampling import shaped_probs as target_probs


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector."""
    cumulative = np.cumsum(p)
    return int(
        min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(p) - 1)
    )


__all__ = ["SamplingParams", "sample", "target_probs"]
