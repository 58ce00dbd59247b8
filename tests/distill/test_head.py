"""The frequency-ranked head's choice of tokens (exstill_sdk/distill/head.py)."""

from __future__ import annotations

import numpy as np

from exstill_sdk.distill.data import Example
from exstill_sdk.distill.head import coverage, default_size, frequency_ranked


def _example(ids: list[int], start: int, top: list[list[int]], logp: list[list[float]]) -> Example:
    return Example(
        np.array(ids, np.int32),
        start,
        np.array(top, np.int32),
        np.array(logp, np.float16),
    )


def test_tokens_are_ranked_by_how_often_the_target_writes_them() -> None:
    examples = [
        # prompt 9 9, answer 4 4 4; the target also gave token 7 probability 0.5 at each step
        _example([9, 9, 4, 4, 4], 2, [[4, 7]] * 3, [[np.log(0.5), np.log(0.5)]] * 3),
        _example([9, 5, 5], 1, [[5, 6], [5, 6]], [[0.0, -30.0]] * 2),
    ]
    # counts: 4 -> 3 + 1.5, 9 -> 3, 5 -> 2 + 2, 7 -> 1.5, 6 -> ~0, then unseen ids by id
    assert frequency_ranked(examples, 12, 6) == [4, 5, 9, 7, 6, 0]
    # special tokens are always kept, ahead of the rest, and the size holds
    assert frequency_ranked(examples, 12, 4, always=[11, 2, 11]) == [2, 11, 4, 5]
    assert frequency_ranked(examples, 12, 1, always=[11, 2]) == [11]
    assert coverage(examples, [4, 5]) == 1.0
    assert coverage(examples, [4]) == 0.6
    assert coverage([], [4]) == 0.0


def test_small_vocabularies_keep_the_whole_head() -> None:
    assert default_size(96) == 0 and default_size(16383) == 0
    assert default_size(49152) == 16384 and default_size(16384) == 16384
