"""The acceptance rules are exact: what they emit follows the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.protocol.messages import Distribution
from exstill_sdk.speculative.acceptance import (
    verify_greedy,
    verify_tokens_only,
    verify_with_distributions,
)
from exstill_sdk.speculative.sampling import SamplingParams, target_probs

VOCAB = 10


def wire(q: np.ndarray) -> Distribution:
    """A draft distribution as the card sends it (u16 weights); returns what q really is."""
    w = np.rint(q * 65535).astype(int)
    ids = np.nonzero(w)[0]
    return Distribution(tuple(int(i) for i in ids), tuple(int(x) for x in w[ids]))


def run_round(
    mode: str, p: np.ndarray, dists: list[Distribution], k: int, rng: np.random.Generator
) -> list[int]:
    draft = []
    for d in dists[:k]:
        weights = np.array(d.weights, float)
        draft.append(int(rng.choice(d.tokens, p=weights / weights.sum())))
    if mode == "dist":
        n, token, _ = verify_with_distributions(draft, dists[:k], p, rng)
    else:
        n, token, _ = verify_tokens_only(draft, p, rng)
    return [*draft[:n], token]


@pytest.mark.parametrize("mode", ["dist", "tokens"])
@pytest.mark.parametrize("k", [2, 3])
def test_converges_to_the_target_distribution(mode: str, k: int) -> None:
    """Like vLLM's rejection-sampler test: every emitted token is a sample of the target
    distribution, so the empirical error to it shrinks with the sample size far faster (here
    at least 20 times) than the error to unrelated reference distributions."""
    rng = np.random.default_rng(k)
    target = rng.dirichlet(np.ones(VOCAB))
    p = np.tile(target, (k + 1, 1))
    draft = rng.dirichlet(np.ones(VOCAB))
    dists = [wire(draft)] * k
    references = [rng.dirichlet(np.ones(VOCAB)) for _ in range(5)]
    sizes = [10, 100, 1_000, 10_000, 100_000]
    counts = np.zeros(VOCAB)
    errors_target, errors_reference = [], []
    drawn = 0
    for size in sizes:
        while drawn < size:
            for t in run_round(mode, p, dists, k, rng):
                counts[t] += 1
            drawn += 1
        empirical = counts / counts.sum()
        errors_target.append(np.abs(empirical - target).sum())
        errors_reference.append(np.mean([np.abs(empirical - r).sum() for r in references]))
    target_gain = errors_target[0] / errors_target[-1]
    reference_gain = errors_reference[0] / errors_reference[-1]
    assert target_gain > 20 * reference_gain, (errors_target, errors_reference)


SHAPES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.8),
]


@pytest.mark.parametrize("params", SHAPES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("mode", ["dist", "tokens"])
def test_first_token_follows_the_shaped_target(params: SamplingParams, mode: str) -> None:
    """Chi-square goodness of fit (p > 0.01) of the first emitted token against the target's
    distribution shaped by temperature, top-k and top-p; tokens outside it never appear."""
    rng = np.random.default_rng(int(params.temperature * 10) + params.top_k)
    logits = rng.normal(0, 2, (4, VOCAB))
    p = target_probs(logits, params)
    dists = [wire(rng.dirichlet(np.ones(VOCAB) * 0.5)) for _ in range(3)]
    n = 20_000
    counts = np.zeros(VOCAB)
    for _ in range(n):
        counts[run_round(mode, p, dists, 3, rng)[0]] += 1
    support = p[0] > 0
    assert counts[~support].sum() == 0
    result = stats.chisquare(counts[support], p[0][support] * n)
    assert result.pvalue > 0.01, (counts, p[0] * n)


def test_greedy_rule() -> None:
    logits = np.eye(5)[[1, 2, 3, 4]]  # argmax 1, 2, 3, 4
    assert verify_greedy([1, 2, 0], logits) == Verdict(2, 3)
    assert verify_greedy([1, 2, 3], logits) == Verdict(3, 4)
    assert verify_greedy([], logits[:1]) == Verdict(0, 1)


def test_target_probs_shaping() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert np.allclose(p, [[0.5 / 0.8, 0.3 / 0.8, 0, 0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert np.allclose(p, [[1, 0, 0, 0]])
    p = target_probs(logits, SamplingParams(temperature=2.0))
    assert np.allclose(p, np.sqrt([0.5, 0.3, 0.15, 0.05]) / np.sqrt([0.5, 0.3, 0.15, 0.05]).sum())
