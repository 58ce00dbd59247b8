"""Token trees against chains at equal verified tokens, with the demo pair on held-out text.

For each budget N (the positions one pass of the target scores: N - 1 drafted tokens and the
token after the kept ones), rounds start at consecutive positions of held-out standard-library
files, with the real text before them as the context: the draft makes a chain of N - 1 tokens
(its top-1 at each step) or a tree of N - 1 nodes (``best_first_tree``, each node one of its
parent's ``top_k`` likeliest children), and greedy verification keeps the longest path that the
target's own greedy continuation from there agrees with (``greedy_path``). The figure is the
mean of the tokens a pass keeps (the kept path and the target's next token); nothing is timed.

The card's own trees are measured on the same rounds: the emulated card's transformer engine
(the firmware's code, in this process) grows a tree of N - 1 nodes as it does for a
``DRAFT_TREE`` (EAGLE-2's levels, ``CARD_TREES``: top-k children a node, as deep as N - 1), so
that what the card drafts is judged against the chain at equal verified tokens too.

Rounds start in real text, not in the target's own output, because a 4.2M target's greedy
output soon repeats itself (``#`` lines, ``_T_T_T``), which any chain keeps whole; real text
is what tells a draft's hesitations apart. The draft runs on the host here (the draft image in
onnxruntime, one distribution per node), so that trees are measured before the card drafts
them.

Timed on a target (the demo's ``large`` or ``small``), each budget's pass is also timed on it
(``verify_curve``: plain steps to score N positions), and each shape's tokens kept a pass over
that cost is the speed-up a free draft of that shape would give there; ``choose_shape`` picks
the best, a tree only where it beats every chain.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from exstill_firmware.engines.base import Sampling
from exstill_firmware.engines.transformer import TransformerEngine

from exstill_sdk.image import open_image
from exstill_sdk.protocol.messages import TreeRequest, parents_from_wire
from exstill_sdk.speculative.shapes import Shape, choose_shape, speedup_limit
from exstill_sdk.speculative.trees import TokenTree, best_first_tree, greedy_path
from exstill_sdk.support.calibration import RankTemperatureFit
from exstill_sdk.support.sampling import SamplingParams, shaped_probs

DEFAULT_BUDGETS = (2, 4, 8, 16, 32, 64)
TREES = ((2, 1.0), (4, 1.0), (2, 0.5), (4, 0.5))
CARD_TREES = (2, 4)
"""The card's trees tried: top-k children a node."""
"""The trees tried, as (top_k, temperature): the draft's distribution is sharpened by the
temperature before cumulative probabilities rank the nodes (a draft that is right more often
than its top probability says spreads a tree too wide at 1.0)."""


def run(
    *,
    files: int = 3,
    context_tokens: int = 96,
    rounds: int = 32,
    budgets: tuple[int, ...] = DEFAULT_BUDGETS,
    trees: tuple[tuple[int, float], ...] = TREES,
    timed_on: str | None = None,
) -> dict[str, Any]:
    """``rounds`` rounds in each of ``files`` held-out files, the first after
    ``context_tokens`` tokens of it; each budget as a chain and as each of ``trees``; with
    ``timed_on``, the passes timed on that demo target and the shape chosen for it."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.demo import POSITIONS, demo_dir, held_out_prompts

    data = demo_dir()
    texts = held_out_prompts(files, context_tokens + rounds)
    target = OnnxTarget(data / "target.img", positions=POSITIONS, threads=1)
    draft = OnnxTarget(data / "draft.img", positions=POSITIONS, threads=1)
    card = TransformerEngine(open_image(data / "draft.img"), rows=1, positions=POSITIONS)
    calibration = RankTemperatureFit()  # the draft's probabilities of the target's tokens
    for text in texts:
        rows_of = [model.verify(0, text[:1], text[1:]) for model in (draft, target)]
        calibration.add(rows_of[0], rows_of[1].argmax(axis=-1))
    for model in (draft, target):
        model.release(0)
    shapes = ((1, 1.0), *trees)  # the chain: the top-1 child of each node
    kept: dict[tuple[int, int, float], list[int]] = {
        (b, k, t): [] for b in budgets for k, t in shapes
    }
    card_kept: dict[tuple[int, int], list[int]] = {(b, k): [] for b in budgets for k in CARD_TREES}
    for text in texts:
        for start in range(context_tokens, context_tokens + rounds):
            context = text[:start]
            reference = target.greedy(context, max(budgets))
            state = card.open_state(POSITIONS, Sampling())
            state.extend(struct.pack(f"<{len(context)}I", *context))
            for budget in budgets:
                for k in CARD_TREES:
                    made = state.propose_tree(TreeRequest(budget - 1, k, budget - 1))
                    n = len(made.parents)
                    tree = TokenTree(
                        struct.unpack(f"<{n}I", made.tokens),
                        parents_from_wire(made.parents),
                    )
                    card_kept[budget, k].append(len(greedy_path(tree, reference)) + 1)
            state.close()
            for k, t in shapes:

                def next_probs(
                    path: list[int], context: list[int] = context, t: float = t
                ) -> np.ndarray:
                    return shaped_probs(draft.verify(0, context, path)[-1], SamplingParams(t))

                for budget in budgets:
                    tree = best_first_tree(next_probs, budget - 1, k)
                    kept[budget, k, t].append(len(greedy_path(tree, reference)) + 1)
    rows = []
    for budget in budgets:
        chain = float(np.mean(kept[budget, 1, 1.0]))
        tried = [
            {
                "top_k": k,
                "temperature": t,
                "tokens_per_pass": round(float(np.mean(kept[budget, k, t])), 3),
            }
            for k, t in trees
        ]
        best = max(tried, key=lambda row: row["tokens_per_pass"])
        on_card = {k: float(np.mean(card_kept[budget, k])) for k in CARD_TREES}
        rows.append(
            {
                "budget": budget,
                "drafted": budget - 1,
                "chain_tokens_per_pass": round(chain, 3),
                "trees": tried,
                "best_tree": best,
                "best_tree_over_chain": round(best["tokens_per_pass"] / chain, 3),
                "card_trees": [
                    {"top_k": k, "tokens_per_pass": round(v, 3), "over_chain": round(v / chain, 3)}
                    for k, v in on_card.items()
                ],
            }
        )
    result: dict[str, Any] = {
        "pair": "demo",
        "files": len(texts),
        "context_tokens": context_tokens,
        "rounds_per_file": rounds,
        "rank_temperature": {
            "image": card.rank_temperature,
            "fit": calibration.best(),
            "positions": calibration.rows,
        },
        "rows": rows,
    }
    if timed_on is not None:
        result["target"] = _choose_for(timed_on, texts[0][:context_tokens], rows)
    return result


def _choose_for(name: str, context: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Time each budget's pass on the demo target ``name``; add each shape's limit to the rows
    and return the choice."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.demo import POSITIONS, demo_target
    from exstill_sdk.harness.speedup import verify_curve

    model = OnnxTarget(demo_target(name).image, positions=POSITIONS, threads=1)
    sizes = sorted({1, *(row["budget"] for row in rows)})
    verify_us = verify_curve(model, context, sizes)

    def steps(positions: int) -> float:
        return verify_us[str(positions)] / verify_us["1"]

    kept: dict[Shape, float] = {}
    for row in rows:
        row["verify_steps"] = round(steps(row["budget"]), 3)
        chain = Shape("chain", row["drafted"])
        kept[chain] = row["chain_tokens_per_pass"]
        row["chain_limit"] = round(speedup_limit(kept[chain], row["budget"], steps), 3)
        best = row["best_tree"]
        tree = Shape("tree", row["drafted"], best["top_k"])
        kept[tree] = best["tokens_per_pass"]
        row["best_tree_limit"] = round(speedup_limit(kept[tree], row["budget"], steps), 3)
    chosen, limit = choose_shape(kept, steps)
    chains = {shape: k for shape, k in kept.items() if shape.kind == "chain"}
    best_chain, chain_limit = choose_shape(chains, steps)
    return {
        "name": name,
        "verify_us": verify_us,
        "chosen": str(chosen),
        "chosen_limit": round(limit, 3),
        "best_chain": str(best_chain),
        "best_chain_limit": round(chain_limit, 3),
    }


def table(result: dict[str, Any]) -> str:
    """The result as a table: tokens kept a pass, by budget, for the chain and each tree."""
    rows = result["rows"]
    heads = [f"k{t['top_k']} T{t['temperature']:g}" for t in rows[0]["trees"]]
    heads += [f"card k{t['top_k']}" for t in rows[0]["card_trees"]]
    lines = [
        f"tokens kept a pass: {result['files']} held-out files x {result['rounds_per_file']} "
        "rounds, demo pair",
        f"{'budget':>6}  {'chain':>6}  " + "  ".join(f"{h:>8}" for h in heads) + "  best/chain",
    ]
    timed = "target" in result
    if timed:
        lines[1] += "  steps  chain limit  tree limit"
    for row in rows:
        trees = "  ".join(
            f"{t['tokens_per_pass']:>8.2f}" for t in [*row["trees"], *row["card_trees"]]
        )
        line = (
            f"{row['budget']:>6}  {row['chain_tokens_per_pass']:>6.2f}  {trees}  "
            f"{row['best_tree_over_chain']:>9.2f}x"
        )
        if timed:
            line += (
                f"  {row['verify_steps']:>5.2f}  {row['chain_limit']:>10.2f}x  "
                f"{row['best_tree_limit']:>9.2f}x"
            )
        lines.append(line)
    cal = result["rank_temperature"]
    lines.append(
        f"the card ranks at the draft image's rank temperature {cal['image']}; this text "
        f"calibrates the draft at {cal['fit']} ({cal['positions']} positions)"
    )
    if timed:
        t = result["target"]
        lines.append(
            f"on the {t['name']} demo target: best chain {t['best_chain']} "
            f"({t['best_chain_limit']:.2f}x with a free draft); chosen: {t['chosen']} "
            f"({t['chosen_limit']:.2f}x)"
        )
    return "\n".join(lines)
