"""``exstill plan --check``: the planner's predictions against this machine's real runs.

For each demo target (the small one, bound by arithmetic, and the large one, bound by reading
its weights), with the emulated card in its own process on its own core and the target and the
host on the other:

1. measure the profiles (plan.measure.profile): the target's passes, the card's drafting and link;
2. a pilot run at every user count (K = 8, so that every position is drafted) gives the
   acceptance of those users' prompts, as a run's JSON; two pilot lengths give the host's own
   time a pass (their difference: the prompt and the streams' opening cancel out);
3. the planner picks K for every user count from those profiles;
4. a speculative run at that K measures tokens/s while every user decodes, as ``exstill-bench
   e2e --users`` counts them, the median of ``repeats`` runs alternated with plain batched
   decoding. Requests are 256 tokens, so that the last round of a request, cut short by its
   length, weighs little against the steady state the planner models;
5. the planner predicts that run from the measured profiles and the run's own acceptance (its
   metrics' JSON, what a user gives ``--acceptance``): what is checked is the model of where a
   round's time goes. The passes the prediction reads are timed again after the runs, and the
   table holds the mean of before and after (``pass_drift``: how far they moved): this shared
   machine's speed drifts over the minutes a row takes. Acceptance measured at K = 8 does not
   carry over exactly to a run at K = 2 (after a rejection the next draft starts elsewhere in
   the text), which would move a row by up to 8%; that prediction is reported too
   (``pilot_acceptance_tokens_per_s``).

The acceptance of the draft's other choices (how often its second, third, ... choice names
the target's token where the target refuses its first) is the draft's ``top_k`` along the
run's own text (draft_ranks.py, as ``exstill eval`` measures it), written into the run's JSON
beside its metrics. With it the chain rows model the card's drafting ahead for the likeliest
outcomes besides full acceptance, as many as fit its budget (``predicted_outcomes_ahead``;
``measured_outcome_hit_rate``: the share of rounds whose next draft came from one of them).

At one user, each target also has a tree row: a run drafting the tree ``TREE`` every round
(the card drafts a tree when its COMMIT comes, never ahead), predicted from the pilot's
acceptance by position and its ``top_k`` (the tree's alternatives are the draft's first
``TREE.top_k`` choices): the tree's acceptance is predicted, not taken from the run. The card
profile prices a tree round as the card timed its tree rounds (each level,
``tree_level_us``, and what a tree costs beyond a chain's first step, ``tree_us``).

Every row prints predicted against measured; the check passes when the largest relative error
of the speculative tokens/s is within ``TOLERANCE``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from exstill_sdk.bench.decode.users import pass_costs, plain_rate, speculative_rate
from exstill_sdk.demo import DRAFT_TARGET
from exstill_sdk.harness.demo_setup import demo_card, demo_onnx_target, user_prompts
from exstill_sdk.plan import (
    CardProfile,
    Projection,
    TargetProfile,
    load_acceptance,
    load_card,
    load_target,
    plan,
    simulate,
)
from exstill_sdk.plan.measure.draft_ranks import demo_draft, draft_top_k
from exstill_sdk.plan.measure.profile import (
    PASS_TURNS,
    PILOT_K,
    ahead_step,
    measure,
    retime,
    write_profiles,
)
from exstill_sdk.plan.shapes import tree_shape
from exstill_sdk.speculative.decoder import DEFAULT_TREES, SpeculativeDecoder
from exstill_sdk.support.prefetch import prefetch_report

TOLERANCE = 0.10
TREE = DEFAULT_TREES[0]
"""The tree row's tree: the smaller of those ``trees="auto"`` weighs."""
WARM_UP_TOKENS = 16
TREE_NAME = f"tree of {TREE.nodes} (top-{TREE.top_k}, depth {TREE.depth})"


def run(
    *,
    targets: Sequence[str] = ("small", "large"),
    users: Sequence[int] = (1, 4, 8, 16),
    new_tokens: int = 256,
    repeats: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    from exstill_sdk.demo import demo_target

    draft = demo_draft()
    with tempfile.TemporaryDirectory() as tmp, demo_card(max(users)) as (card, prompts):
        for name in targets:
            demo = demo_target(name, progress=progress)
            target = demo_onnx_target(demo.image, users, prompts)
            measured = measure(card, target, draft, name, prompts, users, new_tokens, progress)
            profiles[name] = measured
            folder = Path(tmp) / name
            write_profiles(folder, measured)
            bench = _Bench(name, card, target, draft, new_tokens, repeats, folder)
            if 1 in users:
                if progress:
                    print(f"{name}: 1 user, {TREE_NAME} ...", file=sys.stderr, flush=True)
                rows.append(_tree_row(bench, prompts[:1]))
            for u in users:
                if progress:
                    print(f"{name}: {u} users ...", file=sys.stderr, flush=True)
                rows.append(_row(bench, prompts[:u]))
    worst = max(abs(r["error"]) for r in rows)
    return {
        "rows": rows,
        "max_abs_error": round(worst, 3),
        "tolerance": TOLERANCE,
        "ok": worst <= TOLERANCE,
        "profiles": profiles,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }


def _profiles(b: _Bench, batch: list[list[int]]) -> tuple[TargetProfile, CardProfile]:
    """The target and card profiles, the passes of ``len(batch)`` users timed again now, just
    before the runs they predict: a table timed minutes before moved rows at K = 0 by up to
    21% on this shared machine."""
    users = len(batch)
    doc = json.loads((b.folder / "target.json").read_text())
    retime(doc["target"]["pass"], b.target, _half_way(b, batch), users, range(PILOT_K + 1))
    (b.folder / "target.json").write_text(json.dumps(doc, indent=1))
    return load_target(b.folder / "target.json"), load_card(b.folder / "card.json")


def _half_way(b: _Bench, batch: list[list[int]]) -> list[list[int]]:
    """The batch's prompts as long as a run's contexts are half-way, where passes are timed."""
    return user_prompts(len(batch), len(batch[0]) + b.new_tokens // 2)


def _timed_around(
    b: _Bench, batch: list[list[int]], ks: Sequence[int]
) -> tuple[TargetProfile, float]:
    """The target profile with the passes of ``len(batch)`` users with each K in ``ks`` (those
    the prediction reads) timed again after the runs, the mean of before and after in the
    table: this shared machine drifts over the minutes a row's runs take, by as much as 28%
    (docs/planning.md). And how far they moved: after over before, less 1 (the mean over ks)."""
    users = len(batch)
    path = b.folder / "target.json"
    doc = json.loads(path.read_text())
    rows = doc["target"]["pass"]
    after = pass_costs(b.target, _half_way(b, batch), ks, turns=PASS_TURNS)
    moved = []
    for i, (n, tokens) in enumerate(zip(rows["batch"], rows["tokens"], strict=True)):
        if n == users and str(tokens) in after:
            moved.append(after[str(tokens)] / rows["ms"][i] - 1)
            rows["ms"][i] = round((rows["ms"][i] + after[str(tokens)]) / 2, 3)
    path.write_text(json.dumps(doc, indent=1))
    return load_target(path), statistics.mean(moved)


def _alternated(
    b: _Bench, decoder: SpeculativeDecoder, batch: list[list[int]]
) -> tuple[list[float], list[float], list[list[int]]]:
    """Speculative and plain decoding's tokens/s while every user decodes, ``repeats`` runs
    of each in turns; and the text they write (the target's greedy continuations)."""
    spec, plain = [], []
    texts: list[list[int]] = []
    for rep in range(b.repeats):
        for way in ("spec", "plain") if rep % 2 == 0 else ("plain", "spec"):
            if way == "plain":
                rates, texts = plain_rate(b.target, batch, b.new_tokens)
                plain.append(rates["decode"])
            else:
                spec.append(speculative_rate(decoder, batch, b.new_tokens)[0]["decode"])
    return spec, plain, texts


@dataclass(frozen=True)
class _Bench:
    """One demo target's runs: the card and target they use, and where its profiles are."""

    name: str
    card: Any
    target: Any
    draft: Any
    """The card's draft, run here for its ``top_k`` along a run's text (draft_ranks.py)."""
    new_tokens: int
    repeats: int
    folder: Path


def _tree_row(b: _Bench, batch: list[list[int]]) -> dict[str, Any]:
    """One user drafting ``TREE`` every round, predicted (module docstring)."""

    def tree_decoder() -> SpeculativeDecoder:
        return SpeculativeDecoder(
            b.card, b.target, draft=DRAFT_TARGET, k=PILOT_K, max_k=PILOT_K, trees=TREE
        )

    # a short run first: the target's and the card's tree graphs open on their first trees
    speculative_rate(tree_decoder(), batch, WARM_UP_TOKENS)
    _, card_p = _profiles(b, batch)  # the passes timed before the runs: _timed_around reads them
    decoder = tree_decoder()
    before = b.card.stats()
    spec, plain, _ = _alternated(b, decoder, batch)
    target_p, drift = _timed_around(b, batch, [0, TREE.nodes])  # a pass of the tree's tokens
    pilot = load_acceptance(b.folder / "run-1-users.json")
    # the tree's alternatives: the draft's first TREE.top_k choices, a share of 0 where the
    # pilot saw no refusal (the card still grows all TREE.nodes nodes)
    shares = (*pilot.rank_share, *(0.0,) * TREE.top_k)[: TREE.top_k - 1]
    acceptance = replace(pilot, rank_share=shares)
    shape = tree_shape(acceptance, TREE.nodes, TREE.depth)
    predicted = simulate(target_p, card_p, acceptance, 1, shape)
    row = _figures(b, decoder, predicted, spec, plain, before, 1, drift)
    return {**row, "shape": TREE_NAME}


def _row(b: _Bench, batch: list[list[int]]) -> dict[str, Any]:
    """``len(batch)`` users drafting the chain the planner picks, predicted."""
    users = len(batch)
    target_p, card_p = _profiles(b, batch)
    pilot = load_acceptance(b.folder / f"run-{users}-users.json")
    planned, _ = plan(target_p, card_p, pilot, users)
    k = planned.k
    decoder = SpeculativeDecoder(b.card, b.target, draft=DRAFT_TARGET, k=k, max_k=PILOT_K)
    before = b.card.stats()
    spec, plain, texts = _alternated(b, decoder, batch)
    target_p, drift = _timed_around(b, batch, sorted({0, k}))
    acceptance = pilot  # at K = 0 acceptance plays no part
    if k:
        own = b.folder / f"check-{users}-users.json"  # the run's acceptance, as its JSON has it
        top_k = draft_top_k(b.draft, batch, texts, PILOT_K)
        own.write_text(json.dumps({"metrics": decoder.metrics.to_dict(), "top_k": top_k}))
        acceptance = load_acceptance(own)
    predicted = simulate(target_p, card_p, acceptance, users, k)
    row = _figures(b, decoder, predicted, spec, plain, before, users, drift)
    with_pilot = simulate(target_p, card_p, pilot, users, k)
    row["pilot_acceptance_tokens_per_s"] = round(with_pilot.tokens_per_s, 1)
    return {**row, "shape": f"chain of {k}"}


def _figures(
    b: _Bench,
    decoder: SpeculativeDecoder,
    predicted: Projection,
    spec: list[float],
    plain: list[float],
    before: Any,
    users: int,
    drift: float,
) -> dict[str, Any]:
    """A row: predicted against measured, and where a round's time went."""
    ahead = ahead_step(b.card, before)
    prefetch = prefetch_report(b.card.stats(), before)
    measured = statistics.median(spec)
    m = decoder.metrics
    passes = m.rounds / users  # a batch round is a pass (every user drafts to the end)
    return {
        "target": b.name,
        "users": users,
        "k": predicted.k,
        "predicted_tokens_per_s": round(predicted.tokens_per_s, 1),
        "measured_tokens_per_s": round(measured, 1),
        "error": round(predicted.tokens_per_s / measured - 1, 3),
        "predicted_plain_tokens_per_s": round(predicted.plain_tokens_per_s, 1),
        "measured_plain_tokens_per_s": round(statistics.median(plain), 1),
        "predicted_speedup": round(predicted.speedup, 3),
        "measured_speedup": round(measured / statistics.median(plain), 3),
        "predicted_mean_acceptance_length": round(predicted.mean_acceptance_length, 3),
        "measured_mean_acceptance_length": round(m.mean_acceptance_length, 3),
        # where a round's time went: the card's part, and how often its draft made ahead hit
        "predicted_prefetch_hit_rate": round(predicted.prefetch_hit_rate, 3),
        "measured_prefetch_hit_rate": round(m.prefetch_hits / max(1, m.num_drafts), 3),
        # drafting ahead for other outcomes than full acceptance: how many a stream, and how
        # often a round's next draft came from one of them
        "predicted_outcomes_ahead": predicted.outcomes_ahead,
        "measured_outcome_hit_rate": round(prefetch["outcome_hits"] / max(1, m.num_drafts), 3),
        "predicted_card_ms": round(predicted.round_ms.card, 4),
        # the metrics count rounds per sequence; the card's wait is a batch round's
        "measured_card_wait_ms": round(m.card_wait_s / max(1, m.rounds) * users * 1e3, 4),
        # the pass and the card's drafting ahead as they ran (prompt passes included)
        "predicted_verify_ms": round(predicted.round_ms.step + predicted.round_ms.verify_extra, 4),
        "measured_verify_ms_with_prompt": round(m.verify_s / max(1.0, passes) * 1e3, 4),
        "measured_ahead_step_us": round(ahead[1], 1) if ahead else 0.0,
        # the passes the prediction reads, timed after the runs against before them
        "pass_drift": round(drift, 3),
    }
