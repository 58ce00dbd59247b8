"""HFTarget scores a token tree in one forward (a 4-D mask, position ids by depth): each node
as its path would score, the kept path cached as a chain, and greedy decoding by trees token
for token the model's own generate."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exstill_sdk.adapters.hf import HFTarget  # noqa: E402
from exstill_sdk.speculative.trees import (  # noqa: E402
    ROOT,
    TokenTree,
    best_first_tree,
    verify_tree_greedy,
)


def llama(seed: int, attention: str = "sdpa") -> object:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def target(request: pytest.FixtureRequest) -> HFTarget:
    """Both attention implementations: each takes the tree's 4-D mask its own way (eager
    attention once took a boolean mask as 1 and 0, masking nothing)."""
    return HFTarget(llama(0, request.param))


TREE = TokenTree((3, 4, 6, 8, 9, 11, 12), (ROOT, ROOT, 0, 1, 1, 4, 0))


@pytest.mark.parametrize("cached", [0, 1, 4])
def test_each_node_scores_as_its_path_would(target: HFTarget, cached: int) -> None:
    context = [5, 9, 13, 2, 7, 21, 30, 1]
    target.release(0)
    if cached:
        target.verify(0, context[:-cached], [])
    logits = target.verify_tree(0, context, TREE)
    assert logits.shape == (len(TREE) + 1, 96)
    target.release(1)
    np.testing.assert_allclose(logits[0], target.verify(1, context, [])[-1], atol=1e-5)
    for i in range(len(TREE)):
        target.release(1)
        np.testing.assert_allclose(
            logits[i + 1], target.verify(1, context, TREE.path(i))[-1], atol=1e-5
        )


def test_the_kept_path_is_cached_as_a_chain(target: HFTarget) -> None:
    context = list(range(10, 40))
    target.release(0)
    target.verify_tree(0, context, TREE)
    target.keep_path(0, TREE, [1, 4, 5])  # tokens 4, 9, 11
    after = target.verify(0, [*context, 4, 9, 11], [7, 7])
    target.release(1)
    np.testing.assert_allclose(after, target.verify(1, [*context, 4, 9, 11], [7, 7]), atol=1e-5)


def test_greedy_decoding_by_trees_is_generate() -> None:
    model, near = llama(0), llama(0)
    with torch.no_grad():  # a draft that mostly agrees with the target, not always
        for weight in near.parameters():
            weight.add_(torch.randn_like(weight) * 0.005)
    target, draft = HFTarget(model), HFTarget(near)
    prompt = [5, 9, 13, 2, 7, 21]
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=40,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    out: list[int] = []
    off_chain = 0  # kept nodes that are not their parent's likeliest child
    while len(out) < 40:
        context = [*prompt, *out]

        def next_probs(path: list[int], context: list[int] = context) -> np.ndarray:
            logits = draft.verify(0, context, path)[-1]
            z = np.exp(logits - logits.max())
            return z / z.sum()

        tree = best_first_tree(next_probs, 6, 3)
        kept, token = verify_tree_greedy(tree, target.verify_tree(0, context, tree))
        target.keep_path(0, tree, kept)
        firsts = {tree.parents.index(p) for p in set(tree.parents)}
        off_chain += sum(k not in firsts for k in kept)
        out += [tree.tokens[k] for k in kept] + [token]
    assert out[:40] == reference
    assert off_chain > 0  # a branch other than the draft's top choice was kept, and was right
