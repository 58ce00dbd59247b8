"""The smallest complete TargetAdapter: a bigram model in numpy, speculatively decoded with
the card's prompt-lookup engine on the built-in emulator. Run: python examples/minimal_target.py
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from exstill_sdk import open_card
from exstill_sdk.speculative import SpeculativeDecoder, TargetAdapter


class BigramTarget(TargetAdapter):
    """Next-token logits depend only on the previous token: logits = table[previous]."""

    def __init__(self, vocab_size: int = 50, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = ()
        self.table = np.random.default_rng(seed).normal(size=(vocab_size, vocab_size))

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        # One row per position: after context, after context + draft[:1], ..., after the draft.
        previous = [context[-1], *draft]
        return self.table[previous]

    def rollback(self, seq_id: int, length: int) -> None:
        pass  # no cache to trim: every verify recomputes from the tokens it is given


def main() -> None:
    target = BigramTarget()
    prompt = [1, 2, 3, 4]
    plain = list(prompt)
    for _ in range(40):  # the target alone, greedily
        plain.append(int(np.argmax(target.table[plain[-1]])))
    with open_card("emu://") as card:
        decoder = SpeculativeDecoder(card, target, engine="lookup", k="adaptive")
        result = decoder.generate(prompt, max_new_tokens=40)
    assert result.tokens == plain[len(prompt) :], "speculative output must equal the target's"
    print("tokens:", result.tokens)
    print("mean acceptance length:", round(result.metrics.mean_acceptance_length, 2))


if __name__ == "__main__":
    main()
