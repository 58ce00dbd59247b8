"""Greedy decoding with token trees drafted by the card and scored by the target in one pass:
token for token the target's own output, with a fixed tree (for one sequence and for a batch,
whose trees are scored in one pass) and with the shape chosen; where trees cannot run
(sampling) or are not chosen (a batch under "auto") the decoder drafts chains and says why; and
the shape chooser's rules on measured rounds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from exstill_sdk import WireMode, open_card  # noqa: E402
from exstill_sdk.adapters.hf import HFTarget  # noqa: E402
from exstill_sdk.adapters.onnx import OnnxTarget  # noqa: E402
from exstill_sdk.protocol.messages import TreeRequest  # noqa: E402
from exstill_sdk.speculative import AdaptiveK, SamplingParams, SpeculativeDecoder  # noqa: E402
from exstill_sdk.speculative.adaptive import ChainRound  # noqa: E402
from exstill_sdk.speculative.shapes import GAIN_PRIOR, GAIN_PRIOR_TOKENS, TreeChooser  # noqa: E402

from ..firmware.test_transformer import generate  # noqa: E402
from .test_exact_greedy import N_NEW, prompts  # noqa: E402

SHAPES = [TreeRequest(6, 2, 4), TreeRequest(12, 3, 6), "auto"]


@pytest.fixture(scope="module")
def onnx_reference(pair):
    target = OnnxTarget(pair.target_image, max_sequences=1, positions=512)
    return [target.greedy(p, N_NEW) for p in prompts()[:8]]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("draft", ["partly", "never", "lookup"])
def test_tree_rounds_are_the_targets_greedy_output(pair, onnx_reference, draft, shape) -> None:
    target = OnnxTarget(pair.target_image, max_sequences=1, positions=512)
    with open_card(pair.url()) as card:
        decoder = SpeculativeDecoder(
            card, target, draft=None if draft == "lookup" else draft, k=4, trees=shape
        )
        assert decoder.tree_note == ""
        got = [decoder.generate(p, N_NEW, stop_token_ids=[]).tokens for p in prompts()[:8]]
    assert got == onnx_reference
    m = decoder.metrics
    if isinstance(shape, TreeRequest):
        name = f"tree of {shape.nodes} (top-{shape.top_k}, depth {shape.depth})"
        assert set(m.shapes_chosen) == {name}
        # the model's trees branch (lookup's only where the text matched in several places)
        assert m.tree_rounds > 0 or draft == "lookup"
    else:
        assert m.shapes_chosen["chain"] >= 4  # the chain's warm-up rounds at least
    assert m.emitted_tokens == 8 * N_NEW


def test_hf_target_scores_card_trees(pair) -> None:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(pair.target_dir, attn_implementation="eager")
    with open_card(pair.url()) as card:
        decoder = SpeculativeDecoder(
            card, HFTarget(model), draft="partly", k=4, trees=TreeRequest(8, 2, 5)
        )
        for p in prompts()[:3]:
            got = decoder.generate(p, 32, stop_token_ids=[]).tokens
            assert got == generate(model, p, 32)  # HF's own greedy generate
        # a batch: the default verify_drafts (chains batched, each tree a pass of its own)
        batch = decoder.generate_batch(prompts()[3:5], 32, stop_token_ids=[])
        assert [r.tokens for r in batch] == [generate(model, p, 32) for p in prompts()[3:5]]
    assert decoder.metrics.tree_rounds > 0


def test_where_trees_cannot_run_the_decoder_drafts_chains(pair, onnx_reference) -> None:
    target = OnnxTarget(pair.target_image, max_sequences=4, positions=512)
    with open_card(pair.url()) as card:
        sampled = SpeculativeDecoder(
            card,
            target,
            draft="partly",
            sampling=SamplingParams(temperature=0.8, seed=1),
            trees="auto",
            wire_mode=WireMode.TOKENS,  # a sampled tree needs its distributions on the wire
        )
        assert "DIST" in sampled.tree_note
        sampled.generate(prompts()[0], 16, stop_token_ids=[])
        assert sampled.metrics.tree_rounds == 0
        # several sequences at once, shape auto: the chooser runs for a lone sequence only,
        # so the batch drafts chains (four copies of one prompt: their rounds are alike, so
        # none is ever left alone)
        batch = SpeculativeDecoder(card, target, draft="partly", k=4, trees="auto")
        results = batch.generate_batch([prompts()[1]] * 4, N_NEW, stop_token_ids=[])
    assert [r.tokens for r in results] == [onnx_reference[1]] * 4
    assert batch.metrics.tree_rounds == 0 and set(batch.metrics.shapes_chosen) <= {"chain"}


class CountingTarget(OnnxTarget):
    """The ONNX target, counting how the rounds with trees were scored."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batched: list[int] = []  # sequences in each one-pass round that held a tree
        self.alone = 0  # trees scored in a pass of their own

    def verify_drafts(self, items):
        if len(items) > 1:
            self.batched.append(len(items))
        return super().verify_drafts(items)

    def verify_tree(self, seq_id, context, tree):
        self.alone += 1
        return super().verify_tree(seq_id, context, tree)


def test_a_fixed_tree_runs_for_every_sequence_of_a_batch_in_one_pass(pair, onnx_reference) -> None:
    target = CountingTarget(pair.target_image, max_sequences=4, positions=512)
    with open_card(pair.url()) as card:
        decoder = SpeculativeDecoder(card, target, draft="partly", k=4, trees=TreeRequest(6, 2, 4))
        results = decoder.generate_batch(prompts()[:4], N_NEW, stop_token_ids=[])
    assert [r.tokens for r in results] == onnx_reference[:4]
    assert decoder.metrics.tree_rounds > 0
    assert max(target.batched) == 4  # four sequences' trees scored in one pass
    # a tree alone only in a round with one sequence left (all four end near one another)
    assert target.alone <= 2 and target.alone + sum(target.batched) >= decoder.metrics.tree_rounds


def test_tree_rounds_tell_the_chains_k_policy_what_the_text_does(pair, onnx_reference) -> None:
    """Every round of a fixed tree tells the K policy what the chain inside it kept (the
    policy would otherwise know nothing of the text while trees run)."""
    policy = AdaptiveK(8)
    target = OnnxTarget(pair.target_image, max_sequences=1, positions=512)
    with open_card(pair.url()) as card:
        decoder = SpeculativeDecoder(
            card, target, draft="partly", k=policy, trees=TreeRequest(6, 2, 4)
        )
        result = decoder.generate(prompts()[0], N_NEW, stop_token_ids=[])
    assert result.tokens == onnx_reference[0]
    m = result.metrics
    assert m.tree_rounds > 0
    assert policy.acceptance.reached[1] == m.num_drafts  # each round with a draft, once


def test_trees_option_is_checked(pair) -> None:
    target = OnnxTarget(pair.target_image, max_sequences=1, positions=512)
    with open_card(pair.url()) as card, pytest.raises(Exception, match="trees must be"):
        SpeculativeDecoder(card, target, draft="partly", trees="sometimes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the chooser's rules


def feed(
    chooser: TreeChooser, rounds: int, kept: dict[int, int], seconds: float = 1.0
) -> list[int]:
    """``rounds`` rounds, each arm keeping ``kept[arm]`` tokens in ``seconds``: the arms run."""
    out = []
    for _ in range(rounds):
        arm = chooser.choose()
        chooser.observe(arm, kept[arm], seconds)
        out.append(arm)
    return out


def test_chooser_warms_the_chain_up_then_probes_and_keeps_the_best() -> None:
    chooser = TreeChooser([TreeRequest(6, 2, 4), TreeRequest(12, 3, 6)], probe=2, warmup=4)
    ran = feed(chooser, 100, {0: 3, 1: 4, 2: 5})
    # each tree: its first round (not timed), then its probes
    assert ran[:4] == [0, 0, 0, 0] and ran[4:10] == [1, 1, 1, 2, 2, 2]
    assert ran[10:31] == [2] * 21  # the best by tokens a second
    assert ran[31] == 0 and ran[63] == 1  # every 32 rounds, the shape measured longest ago
    assert ran.count(2) == 100 - 6 - 4


def test_chooser_tries_no_tree_that_cannot_beat_a_whole_chain() -> None:
    chooser = TreeChooser([TreeRequest(6, 2, 4), TreeRequest(12, 3, 6)], warmup=4)
    # chain rounds keep 9 tokens: no tree of depth 4 or 6 can keep more
    assert set(feed(chooser, 40, {0: 9, 1: 5, 2: 7})) == {0}


def test_chooser_needs_a_margin_over_the_chain() -> None:
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=4, margin=1.1)
    ran = feed(chooser, 30, {0: 100, 1: 105}, seconds=1.0)  # the tree 5% ahead: not enough
    assert ran[6:].count(1) <= 1


def test_fixed_chooser_always_gives_its_tree() -> None:
    chooser = TreeChooser([TreeRequest(8, 2, 6)], fixed=True)
    assert set(feed(chooser, 10, {0: 1, 1: 1})) == {1}
    with pytest.raises(ValueError):
        TreeChooser([TreeRequest(8, 2, 6), TreeRequest(6, 2, 4)], fixed=True)


def test_chooser_decides_per_sequence_whether_a_tree_can_win() -> None:
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3)
    # a sequence whose chain rounds keep 3 tokens: the tree (7 at most) is tried and wins
    assert feed(chooser, 10, {0: 3, 1: 5})[3:] == [1] * 7
    # a new sequence whose text a chain takes whole (9 a round): the chain
    chooser.start()
    assert feed(chooser, 10, {0: 9, 1: 5}) == [0] * 10
    # and one like the first again: the tree is measured anew, and wins again
    chooser.start()
    assert feed(chooser, 10, {0: 3, 1: 5}) == [0, 0, 0] + [1] * 7
    # a tree that keeps its whole depth sends the next round back to the chain
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3)
    assert feed(chooser, 6, {0: 3, 1: 7}) == [0, 0, 0, 1, 0, 1]


def test_chooser_times_the_chain_by_its_steady_rounds() -> None:
    """A chain round after a tree finds no draft made ahead: slow, and not the chain's rate."""
    chooser = TreeChooser([TreeRequest(8, 2, 6)], margin=1.1)
    for _ in range(2):  # chain rounds, the second after a chain round: 3 tokens a second
        chooser.observe(0, 3, 1.0)
    for _ in range(2):  # a tree round (3.2 a second), then a chain round drafted on the spot
        chooser.observe(1, 4, 1.25)
        chooser.observe(0, 3, 2.0)
    assert chooser.rate(0) == 3.0  # counted, the slow rounds would make it 2.0
    assert chooser.best([1]) == 0  # so the tree, 7% ahead of the steady chain, does not run


def test_chooser_weighs_trees_against_the_chain_the_policy_expects() -> None:
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3, probe=1)
    ran = feed(chooser, 6, {0: 3, 1: 5})  # the tree keeps 5 a second, the chain's rounds 3
    assert ran[-1] == 1
    # the K policy expects 6 a second of the chain at the K it would settle on: the chain
    assert chooser.choose(chain_rate=6.0) == 0
    assert chooser.choose(chain_rate=4.0) == 1


def test_chooser_does_not_probe_a_tree_that_cannot_win() -> None:
    """A tree of 8 nodes, depth 6: at best 7 tokens in a pass of 9 tokens. Against a chain the
    policy expects 6 tokens a second of, a pass of 9 tokens taking 1.5 s (7 / 1.5 = 4.7 at
    best) is not worth a probe; one taking 1 s (7 a second) is."""
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3)
    feed(chooser, 3, {0: 3})  # the chain's warm-up: 3 tokens a round, so the tree is eligible
    assert chooser.choose(chain_rate=6.0, verify_s=lambda n: 1.5) == 0
    assert chooser.choose(chain_rate=6.0, verify_s=lambda n: 1.0) == 1
    assert chooser.choose(chain_rate=6.0, verify_s=lambda n: None) == 1  # unknown: probed


def test_a_tree_whose_rounds_are_too_slow_to_win_is_not_probed_again() -> None:
    """A tree of 8 nodes, depth 6, keeps at most 7 tokens a round: once a round of it has
    taken 1.5 s (its pass, the card drafting it while the target waits), it cannot beat a chain
    the policy expects 6 tokens a second of, in this sequence or the next."""
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3)
    feed(chooser, 3, {0: 3})  # the chain's warm-up: 3 tokens a round, so the tree is eligible
    assert chooser.choose(chain_rate=6.0, verify_s=lambda n: 0.5) == 1  # its pass alone: 0.5 s
    chooser.observe(1, 5, 9.0)  # its first round: not timed
    assert chooser.choose(chain_rate=6.0, verify_s=lambda n: 0.5) == 1
    chooser.observe(1, 5, 1.5)
    assert chooser.choose(chain_rate=6.0, verify_s=lambda n: 0.5) == 0
    assert chooser.choose(chain_rate=4.0, verify_s=lambda n: 0.5) == 1  # a slower chain: it can
    for _ in range(2):  # the next sequence it rests (it lost); in the one after, it is eligible
        chooser.start()
        feed(chooser, 3, {0: 3})
        assert chooser.choose(chain_rate=6.0, verify_s=lambda n: 0.5) == 0
    assert chooser.choose(chain_rate=4.0, verify_s=lambda n: 0.5) == 1


def test_a_trees_first_round_is_not_timed() -> None:
    """The first tree round of a process pays for building the target's tree path (528 ms
    against 44 ms for the next round on the large demo target). Timed, that one round made the
    tree look unable to win, and it was never probed again."""
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3, probe=2)
    feed(chooser, 3, {0: 3})
    assert chooser.choose(chain_rate=3.0, verify_s=lambda n: 0.5) == 1
    chooser.observe(1, 5, 12.0)  # cold: 0.4 tokens a second
    assert chooser.rate(1) is None
    assert chooser.could_win(1, 3.0, lambda n: 0.5)
    for _ in range(2):  # the probes, timed: 5 a second
        assert chooser.choose(chain_rate=3.0, verify_s=lambda n: 0.5) == 1
        chooser.observe(1, 5, 1.0)
    assert chooser.rate(1) == 5.0
    assert chooser.choose(chain_rate=3.0, verify_s=lambda n: 0.5) == 1  # and it runs


def test_a_tree_that_keeps_losing_is_probed_in_fewer_sequences() -> None:
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=2, probe=2)

    def sequences(n: int, kept: dict[int, int]) -> list[bool]:
        """Whether the tree ran in each of ``n`` new sequences."""
        out = []
        for _ in range(n):
            chooser.start()
            out.append(feed(chooser, 10, kept).count(1) > 0)
        return out

    # the tree (2 a second) loses to the chain (3): it rests 1, then 3, then 7 sequences
    assert sequences(12, {0: 3, 1: 2}) == [True, False, True] + [False] * 3 + [True] + [False] * 5
    # the text changes and the tree would win, but it rests until its next probe
    assert sequences(3, {0: 3, 1: 5}) == [False, False, True]
    # having won, it runs in every sequence again
    assert sequences(3, {0: 3, 1: 5}) == [True, True, True]


def test_a_tree_is_judged_against_the_chain_on_its_own_rounds() -> None:
    """The chain's warm-up rounds keep 1 token a second; then the text grows easy and the tree
    keeps 5 tokens in 2 s, the chain inside it 4 of its drafted tokens. Against the warm-up
    rounds the tree looks 2.5 times better; a chain of 4, whose steady round takes 1.2 s, would
    have kept the same 5 tokens there (4.2 a second): the chain runs."""
    seconds = [1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.4]  # of a steady round by K
    chain_rounds = [ChainRound(1.0 + k, s) for k, s in enumerate(seconds)]
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3, probe=2)
    feed(chooser, 3, {0: 1})
    for _ in range(3):  # its first round (not timed), then the probes
        assert chooser.choose(chain_rounds=chain_rounds) == 1
        chooser.observe(1, 5, 2.0, chain_kept=4)
    assert chooser.chain_on_rounds_of(1, chain_rounds) == 5 / 1.2
    assert chooser.choose() == 1  # without the chain's costs: the warm-up rounds' 1 a second
    assert chooser.choose(chain_rounds=chain_rounds) == 0
    # where the chain inside missed at once (it keeps 1 token whatever its K, 1 a second), the
    # tree's 2.5 a second wins
    chooser = TreeChooser([TreeRequest(8, 2, 6)], warmup=3, probe=2)
    feed(chooser, 3, {0: 1})
    for _ in range(3):
        assert chooser.choose(chain_rounds=chain_rounds) == 1
        chooser.observe(1, 5, 2.0, chain_kept=0)
    assert chooser.chain_on_rounds_of(1, chain_rounds) == 1.0
    assert chooser.choose(chain_rounds=chain_rounds) == 1


def test_a_tree_is_probed_only_where_its_gain_over_its_inside_chain_could_win() -> None:
    """The policy expects a chain of the tree's depth (6) to keep 2 tokens a round here, and its
    best chain to give 2.2 tokens a second; a pass of the tree takes 1 s. At the prior gain
    (1.3: 2.6 tokens a second) the tree might win by the margin (2.42), so it is worth a probe;
    once its rounds kept no more than the chain inside it, it cannot; where they kept far more,
    it still can. Keeping its whole depth (7 a second), any tree could."""
    chain_rounds = [ChainRound(1.0 + k / 6, 1.0) for k in range(7)]  # depth 6: 2 tokens

    def gain_and_chance(tree_kept: int, chain_kept: int) -> tuple[float, bool]:
        chooser = TreeChooser([TreeRequest(8, 2, 6)])
        assert chooser.gain(1) == GAIN_PRIOR
        assert chooser.could_win(1, 2.2, lambda n: 1.0, chain_rounds)
        assert chooser.could_win(1, 2.2, lambda n: 1.0)  # the policy's outlook unknown
        for _ in range(2):
            chooser.observe(1, tree_kept, 1.0, chain_kept=chain_kept)
        return chooser.gain(1), chooser.could_win(1, 2.2, lambda n: 1.0, chain_rounds)

    gain, chance = gain_and_chance(tree_kept=3, chain_kept=2)  # what its chain kept
    assert gain == (6 + GAIN_PRIOR * GAIN_PRIOR_TOKENS) / (6 + GAIN_PRIOR_TOKENS)
    assert not chance
    gain, chance = gain_and_chance(tree_kept=5, chain_kept=1)  # two tokens more a round
    assert gain == (10 + GAIN_PRIOR * GAIN_PRIOR_TOKENS) / (4 + GAIN_PRIOR_TOKENS)
    assert chance
