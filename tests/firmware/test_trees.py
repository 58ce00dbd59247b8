"""Token trees drafted on the card: the transformer engine's tree against the same growth
worked out from HF transformers' logits, prompt lookup's branches against a brute-force search,
and the rounds on the wire (DRAFT_TREE, COMMIT_TREE) with their refusals."""

from __future__ import annotations

import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exstill_firmware import CardRuntime  # noqa: E402
from exstill_firmware.engines.base import Sampling  # noqa: E402
from exstill_firmware.engines.lookup import LookupEngine  # noqa: E402
from exstill_firmware.engines.sampling import distribution, draw_index, tree_draws  # noqa: E402
from exstill_firmware.engines.transformer import TransformerEngine  # noqa: E402

from exstill_sdk.card import Card  # noqa: E402
from exstill_sdk.errors import InvalidArgumentError  # noqa: E402
from exstill_sdk.image import open_image  # noqa: E402
from exstill_sdk.image.pack import pack_checkpoint  # noqa: E402
from exstill_sdk.image.reader import DEFAULT_RANK_TEMPERATURE  # noqa: E402
from exstill_sdk.protocol.constants import Features, Opcode, WireMode  # noqa: E402
from exstill_sdk.protocol.drafts import Distribution, Verdict  # noqa: E402
from exstill_sdk.protocol.messages import (  # noqa: E402
    CommitTreeRequest,
    TreeRequest,
    encode_commit_tree_request,
    parents_from_wire,
)
from exstill_sdk.support.trees import grow_sampled_tree  # noqa: E402
from exstill_sdk.transport.emu import EmuTransport  # noqa: E402

from .test_transformer import generate, hf_logits, tokens, unpack  # noqa: E402


def grown_tree(
    model,
    context: list[int],
    nodes: int,
    top_k: int,
    depth: int,
    temperature: float = DEFAULT_RANK_TEMPERATURE,
) -> tuple[list[int], list[int]]:
    """EAGLE-2's growth (TransformerEngine.draft_tree) from HF's logits, path by path: levels
    of each expanded node's top-k children, the top-k best of a level expanded, the ``nodes``
    best of all kept, ranked by the product of the probabilities at the image's rank
    ``temperature`` along the path; (tokens, parents) in the order made."""
    made: list[tuple[int, int, float, list[int]]] = []  # token, parent, value, path

    def children(parent: int) -> list[int]:
        path = made[parent][3] if parent >= 0 else []
        logits = hf_logits(model, context + path)[-1].astype(np.float64)
        probs = np.exp((logits - logits.max()) / temperature)
        probs /= probs.sum()
        base = made[parent][2] if parent >= 0 else 1.0
        out = []
        for t in sorted(np.argsort(-probs)[:top_k].tolist(), key=lambda t: (-probs[t], t)):
            out.append(len(made))
            made.append((t, parent, base * probs[t], [*path, t]))
        return out

    level = children(-1)
    for _ in range(depth - 1):
        beam = sorted(sorted(level, key=lambda i: (-made[i][2], i))[:top_k])
        level = [child for node in beam for child in children(node)]
    keep = sorted(sorted(range(len(made)), key=lambda i: (-made[i][2], i))[:nodes])
    index = {node: i for i, node in enumerate(keep)}
    return [made[i][0] for i in keep], [index.get(made[i][1], -1) for i in keep]


def test_transformer_tree_is_the_growth_of_hf_logits(model_pair) -> None:
    model, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=2, positions=256)
    state = engine.open_state(256, Sampling())
    context = tokens(20)
    state.extend(struct.pack(f"<{len(context)}I", *context))
    shape = TreeRequest(12, 3, 4)
    for _ in range(3):
        proposal = state.propose_tree(shape)
        want_tokens, want_parents = grown_tree(model, context, 12, 3, 4)
        assert unpack(proposal.tokens) == want_tokens
        assert list(parents_from_wire(proposal.parents)) == want_parents
        assert len(set(zip(want_tokens, want_parents, strict=True))) == 12  # no twin siblings
        # commit a path of two (the deepest node's first two) and a token the draft did not
        # guess, as a round would: the cache holds the tree's scratch, and must not be used
        node = max(range(12), key=lambda i: (want_parents[i] >= 0, -i))
        path = [want_parents[node], node] if want_parents[node] >= 0 else [node]
        kept = [want_tokens[i] for i in path] + [5]
        state.extend(struct.pack(f"<{len(kept)}I", *kept))
        context += kept
    # a chain after trees is HF's greedy continuation
    assert unpack(state.propose(6).tokens) == generate(model, context, 6)


def test_the_tree_is_ranked_at_the_images_rank_temperature(model_pair, tmp_path) -> None:
    """An image packed with a rank temperature (exstill distill fits one) grows its trees by
    its softmax at that temperature: the same weights packed with 4.0 grow another tree."""
    model, image, directory = model_pair
    warm = tmp_path / "warm.img"
    pack_checkpoint(directory, warm, "warm", "f32", rank_temperature=4.0)
    shape, differ = TreeRequest(10, 4, 5), 0
    for seed in range(4):
        context = tokens(12, seed)
        made = []
        for path in (image, warm):
            with open_image(path) as opened:
                state = TransformerEngine(opened, rows=1, positions=128).open_state(128, Sampling())
                state.extend(struct.pack(f"<{len(context)}I", *context))
                tree = state.propose_tree(shape)
                made.append((unpack(tree.tokens), list(parents_from_wire(tree.parents))))
                state.close()
        assert made[0] == grown_tree(model, context, 10, 4, 5)
        assert made[1] == grown_tree(model, context, 10, 4, 5, temperature=4.0)
        differ += made[0] != made[1]
    assert differ  # the temperature changes what the card drafts


def test_long_context_streams_draft_chains(model_pair) -> None:
    model, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=2, positions=256)
    context = tokens(10)
    packed = struct.pack(f"<{len(context)}I", *context)
    greedy_long = engine.open_state(256, Sampling(), long_context=True)
    greedy_long.extend(packed)
    proposal = greedy_long.propose_tree(TreeRequest(8, 4, 5))
    assert unpack(proposal.tokens) == generate(model, context, 5)  # depth 5: a chain of 5
    assert parents_from_wire(proposal.parents) == (-1, 0, 1, 2, 3)


def test_a_sampled_tree_is_drawn_from_hf_distributions(model_pair) -> None:
    """A sampled stream's tree against the same growth (support/trees.py) fed HF's logits,
    shaped as the card shapes a chain's (DIST mode) and drawn with the same generators: the
    same tokens, parents and distributions (weights within one unit of rounding)."""
    model, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=2, positions=256)
    context = tokens(9, seed=4)
    sampling = Sampling(temperature=1.0, seed=8, max_entries=255)
    state = engine.open_state(256, sampling)
    state.extend(struct.pack(f"<{len(context)}I", *context))
    shape = TreeRequest(10, 3, 4)
    made = state.propose_tree(shape)
    state.close()

    def path(node: int, tokens: list[int], parents: list[int]) -> list[int]:
        return [] if node < 0 else [*path(parents[node], tokens, parents), tokens[node]]

    def open_nodes(nodes, tokens, parents):
        rows = [hf_logits(model, context + path(n, tokens, parents))[-1] for n in nodes]
        return [distribution(row, sampling) for row in rows]

    def draw(node: int, weights: np.ndarray) -> int:
        return draw_index(weights.astype(np.int64), generators[node])

    generators = {n: tree_draws(8, len(context), n) for n in range(-1, shape.nodes)}
    want = grow_sampled_tree(open_nodes, shape.nodes, shape.top_k, shape.levels, draw)
    assert unpack(made.tokens) == want.tokens
    assert parents_from_wire(made.parents) == tuple(want.parents)
    assert len(want.tokens) == shape.nodes and len(set(want.parents)) < shape.nodes  # branches
    assert made.dists is not None and len(made.dists) == len(want.tokens)
    for parent, dist in zip(want.parents, made.dists, strict=True):
        ids, weights = want.drawn_from[parent]
        assert dist.tokens == tuple(ids.tolist())
        assert np.abs(np.array(dist.weights) - weights.astype(int)).max() <= 1
    # siblings were drawn without replacement: never the same token twice
    for parent in set(want.parents):
        siblings = [t for t, p in zip(want.tokens, want.parents, strict=True) if p == parent]
        assert len(siblings) == len(set(siblings))


def lookup_branches(context: list[int], ns: range, top_k: int, depth: int) -> list[list[int]]:
    """Brute force: the continuations after the latest earlier occurrences of the context's
    last n-gram, longest n first, latest first, each position once (repeating a pattern that
    runs into the end)."""
    out: list[list[int]] = []
    seen: set[int] = set()
    for n in reversed(ns):
        key = context[-n:]
        for j in range(len(context) - 1, n - 1, -1):
            if context[j - n : j] == key and j not in seen:
                seen.add(j)
                src = context[j:]
                out.append((src * (depth // len(src) + 1))[:depth])
    return out[:top_k]


@pytest.mark.parametrize("seed", range(6))
def test_lookup_tree_merges_the_latest_matches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 4, 60).tolist()  # a small alphabet: many matches
    state = LookupEngine(2, 4).open_state(256, Sampling())
    state.extend(struct.pack(f"<{len(context)}I", *context))
    proposal = state.propose_tree(TreeRequest(10, 3, 5))
    got_tokens, got_parents = unpack(proposal.tokens), parents_from_wire(proposal.parents)
    branches = lookup_branches(context, range(2, 5), 3, 5)
    paths = set()
    for i in range(len(got_tokens)):
        path, node = [], i
        while node >= 0:
            path.append(got_tokens[node])
            node = got_parents[node]
        paths.add(tuple(reversed(path)))
    # the branches' prefixes level by level, each branch in turn, each prefix once: the
    # first ``nodes`` of them
    order = [tuple(b[:d]) for d in range(1, 6) for b in branches if len(b) >= d]
    assert paths == set(list(dict.fromkeys(order))[:10])
    assert branches and len(paths) == len(got_tokens)


def test_tree_rounds_on_the_wire() -> None:
    card = Card(EmuTransport(CardRuntime(4, 256, prefetch=False), owns_runtime=True))
    assert card.info().features & Features.TREES
    stream = card.open_stream("lookup")
    stream.prefill([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 9, 1, 2, 3])
    draft = stream.draft_tree(TreeRequest(8, 3, 4))
    assert draft.tokens[:3] == (6, 5, 4) and draft.parents is not None
    assert draft.parents[:4] == (-1, -1, -1, 0)
    # the host refuses a verdict that names no path of the tree; so does the card, and then
    # nothing changes
    for verdict in (Verdict(1, 7), Verdict(2, 7, (1, 3))):  # node 3 is not node 1's child
        with pytest.raises(InvalidArgumentError, match="not a path"):
            stream.commit(verdict, 4)
    with pytest.raises(InvalidArgumentError, match="COMMIT_TREE"):
        card.request(Opcode.COMMIT, struct.pack("<BBI", 1, 4, 7), stream.handle)
    bad = encode_commit_tree_request(CommitTreeRequest((1, 3), 7, TreeRequest(4, 2)))
    with pytest.raises(InvalidArgumentError, match="not a path"):
        card.request(Opcode.COMMIT_TREE, bad, stream.handle)
    assert card.stats()["rounds"] == 0
    assert stream.rollback(16) == 16  # the card still holds 16 tokens
    assert stream.draft_tree(TreeRequest(8, 3, 4)) == draft
    # the path 6, 9 and the target's 1: the text now ends ... 6 9 1, after which came 2 3
    nxt = stream.commit(Verdict(2, 1, (0, 3)), TreeRequest(4, 2, 3))
    assert stream.length == 19 and nxt.tokens[:2] == (2, 3)
    # a chain draft's verdict travels as COMMIT_TREE when a tree comes next
    stream.rollback(16)
    chain = stream.draft(3)
    tree = stream.commit(Verdict(len(chain.tokens), 2), TreeRequest(6, 2, 3))
    assert stream.length == 16 + len(chain.tokens) + 1 and tree.tokens


def test_sampled_streams_refuse_trees_with_branches_without_their_distributions() -> None:
    card = Card(EmuTransport(CardRuntime(4, 256, prefetch=False), owns_runtime=True))
    stream = card.open_stream("lookup", temperature=0.8)  # TOKENS wire mode
    stream.prefill([1, 2, 3, 1, 2])
    with pytest.raises(InvalidArgumentError, match="DIST wire mode"):
        stream.draft_tree(TreeRequest(8, 2, 4))
    assert stream.draft_tree(TreeRequest(4, 1, 4)).tokens == (3, 1, 2, 3)  # top-k 1: a chain
    # in DIST mode lookup's tree is a chain too (its branches were not drawn), each token
    # one-hot
    stream = card.open_stream("lookup", temperature=0.8, wire_mode=WireMode.DIST)
    stream.prefill([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 9, 1, 2, 3])
    draft = stream.draft_tree(TreeRequest(8, 3, 4))
    assert draft.tokens == (6, 9, 1, 2) and draft.parents is None
    assert draft.dists == tuple(Distribution((t,), (1,)) for t in draft.tokens)


def test_sampled_tree_rounds_on_the_wire(model_pair) -> None:
    """A sampled DIST stream's tree comes with each node's distribution, siblings sharing
    their parent's; the same stream state and seed draft the same tree; a round commits a path
    through it."""
    _, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=2, positions=256)
    card = Card(EmuTransport(CardRuntime(2, 256, [engine], prefetch=False), owns_runtime=True))
    assert card.info().features & Features.SAMPLED_TREES
    stream = card.open_stream(
        None, target=engine.name, temperature=1.0, seed=3, wire_mode=WireMode.DIST
    )
    stream.prefill(tokens(12, seed=5))
    draft = stream.draft_tree(TreeRequest(12, 4, 3))
    assert draft.parents is not None and draft.dists is not None
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        assert draft.dists[node].probability(token) > 0
        assert draft.dists[node] == draft.dists[draft.parents.index(parent)]
    assert stream.draft_tree(TreeRequest(12, 4, 3)) == draft
    second = draft.parents.index(-1, 1)  # the context's second child
    nxt = stream.commit(Verdict(1, 7, (second,)), TreeRequest(12, 4, 3))
    assert stream.length == 14 and nxt.dists is not None and nxt != draft
