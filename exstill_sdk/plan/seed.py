"""``exstill plan --seed``: the seed's published figures against the planner's, from the seed's
own inputs (``data/scenarios/seed.toml``: the targets anchored to its plain speeds, its card, its
acceptance).

For every point it prints the planner's figure and the difference, and where the two differ by
more than ``TOLERANCE``, what would close the gap, taken apart:

- ``free card``: the planner again with a card that costs nothing (every draft made ahead, no
  link, no host): what the target and the acceptance allow. If that reaches the seed's figure,
  the card's costs are the gap, and ``draft_us_needed`` is how fast the card would have to
  draft a token to come within the tolerance (the seed says about 50 us);
- ``needed``: the tokens a pass would have to keep at the best shape's verification cost to
  reach the figure, and with verification free (a pass costing one plain step), against what
  the best shape keeps; and what a pass would have to cost, in plain steps, for the best
  shape's tokens to give the figure;
- ``at the seed's shape``: where the seed names the shape it drafts, the planner at that shape.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from exstill_sdk.plan.acceptance import Acceptance, load_acceptance
from exstill_sdk.plan.profiles import (
    SHIPPED,
    CardProfile,
    Fields,
    ProfileError,
    TargetProfile,
    load_card,
    load_target,
    read_document,
)
from exstill_sdk.plan.shapes import named_shape
from exstill_sdk.plan.simulate import Projection, plan

SCENARIO = SHIPPED.parent / "scenarios" / "seed.toml"
TOLERANCE = 0.10


def free(card: CardProfile) -> CardProfile:
    """``card`` at no cost: drafting, the link and the host free."""
    return replace(
        card,
        draft_us_per_token=1e-9,
        stream_us_per_token=0.0,
        ahead_us_per_token=1e-9,
        ahead_stream_us_per_token=0.0,
        round_us=0.0,
        commit_us=0.0,
        miss_us=0.0,
        miss_stream_us=0.0,
        link_rtt_us=0.0,
        host_us_per_round=0.0,
        host_us_per_sequence=0.0,
    )


def compare(path: str | Path = SCENARIO, rounds: int | None = None) -> dict[str, Any]:
    """Every point of the scenario, the seed's figure beside the planner's (module docstring)."""
    doc = Fields(Path(path).name, read_document(path), "").only("card", "acceptance", "point")
    card = load_card(doc.text("card"))
    acceptance = load_acceptance(doc.text("acceptance"))
    points = doc.table.get("point")
    if not isinstance(points, list) or not points:
        raise ProfileError(f"{doc.source}: point must be a list of tables ([[point]])")
    rows = [
        _point(Fields(doc.source, p, f"point[{i}]"), card, acceptance, rounds)
        for i, p in enumerate(points)
    ]
    return {
        "scenario": str(path),
        "card": card.name,
        "acceptance": acceptance.source,
        "tolerance": TOLERANCE,
        "within": sum(r["within"] for r in rows),
        "points": rows,
    }


def _point(
    p: Fields, card: CardProfile, acceptance: Acceptance, rounds: int | None
) -> dict[str, Any]:
    fields = ("figure", "target", "users", "speedup", "tokens_per_s", "plain_tokens_per_s")
    p.only(*fields, "shape")
    target = load_target(p.text("target"))
    users = p.integer("users")
    best, _ = plan(target, card, acceptance, users, rounds=rounds)
    if p.has("speedup"):
        seed, planner, unit = p.number("speedup", positive=True), best.speedup, "x"
    else:
        seed, planner, unit = p.number("tokens_per_s", positive=True), best.tokens_per_s, "tok/s"
    out: dict[str, Any] = {
        "figure": p.text("figure"),
        "target": target.name,
        "users": users,
        "unit": unit,
        "seed": seed,
        "planner": round(planner, 3 if unit == "x" else 1),
        "difference": round(planner / seed - 1, 4),
        "within": abs(planner / seed - 1) <= TOLERANCE,
        "shape": best.shape,
        "verify_over_plain": round(_verify_ratio(best), 3),
        "mean_acceptance_length": round(best.mean_acceptance_length, 3),
        "prefetch_hit_rate": round(best.prefetch_hit_rate, 3),
    }
    if p.has("plain_tokens_per_s"):
        out["seed_plain_tokens_per_s"] = p.number("plain_tokens_per_s", positive=True)
        out["planner_plain_tokens_per_s"] = round(best.plain_tokens_per_s, 1)
    scale = seed / planner * best.speedup  # the seed's figure as a speed-up over the plain step
    if p.has("shape"):
        at = plan(target, card, acceptance, users, named_shape(acceptance, p.text("shape")),
                  rounds=rounds)[0]  # fmt: skip
        out["at_seed_shape"] = {
            "shape": at.shape,
            "speedup": round(at.speedup, 3),
            "difference": round(at.speedup / scale - 1, 4),
        }
    if not out["within"]:
        limit, _ = plan(target, free(card), acceptance, users, rounds=rounds)
        out["free_card"] = {
            "shape": limit.shape,
            "speedup": round(limit.speedup, 3),
            "difference": round(limit.speedup / scale - 1, 4),
        }
        ratio = _verify_ratio(limit)
        out["needed"] = {
            "tokens_a_pass_at_best_verify_cost": round(scale * ratio, 2),
            "verify_over_plain": round(ratio, 3),
            "tokens_a_pass_with_free_verification": round(scale, 2),
            "best_shape_keeps": round(limit.mean_acceptance_length, 2),
            "verify_over_plain_for_best_shape": round(limit.mean_acceptance_length / scale, 3),
        }
        if out["difference"] < 0 and limit.speedup >= scale * (1 - TOLERANCE):
            goal = scale * (1 - TOLERANCE)
            out["draft_us_needed"] = _draft_us_needed(target, card, acceptance, users, goal)
        out["gap"] = _gap(out)
    return out


def _draft_us_needed(
    target: TargetProfile, card: CardProfile, acceptance: Acceptance, users: int, goal: float
) -> float | None:
    """The slowest drafting, microseconds a token, at which the planner gives ``goal``; None
    if even free drafting does not (the link or the host is the gap)."""
    rounds = 4000

    def speedup(us: float) -> float:
        faster = replace(card, draft_us_per_token=us, ahead_us_per_token=us)
        return plan(target, faster, acceptance, users, rounds=rounds)[0].speedup

    lo, hi = 1e-3, card.draft_us_per_token
    if speedup(lo) < goal:
        return None
    for _ in range(8):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid) >= goal else (lo, mid)
    return round(lo, 1)


def _verify_ratio(p: Projection) -> float:
    """The verification pass over a plain step of the same users."""
    return (p.round_ms.step + p.round_ms.verify_extra) / p.round_ms.step


def _gap(row: dict[str, Any]) -> str:
    """Which input keeps the planner from the seed's figure, in words."""
    limit, need = row["free_card"], row["needed"]
    if row["difference"] > 0:
        return (
            f"the planner gives more: its best shape, {row['shape']}, keeps "
            f"{row['mean_acceptance_length']:.2f} tokens a pass for a pass of "
            f"{row['verify_over_plain']:.2f} plain steps; the figure follows from a pass of "
            f"{need['verify_over_plain_for_best_shape']:.2f} plain steps at a free card's best "
            f"shape, {limit['shape']}"
        )
    if "draft_us_needed" in row:
        us = row["draft_us_needed"]
        how = (
            f"drafting at {us:g} us a token or faster (the seed's card: about 50) comes within "
            f"{TOLERANCE:.0%}"
            if us is not None
            else "faster drafting alone does not reach it: the link and the host are the rest"
        )
        return (
            f"the card: at no cost (every draft made ahead, no link) the planner gives "
            f"{limit['speedup']:.2f}x ({limit['difference']:+.0%}); drafting hides behind "
            f"verification in {row['prefetch_hit_rate']:.0%} of rounds; {how}"
        )
    return (
        f"the acceptance and the target: even at no card cost the best, {limit['shape']}, "
        f"keeps {need['best_shape_keeps']:.2f} tokens a pass for a pass of "
        f"{need['verify_over_plain']:.2f} plain steps; the figure needs "
        f"{need['tokens_a_pass_at_best_verify_cost']:.2f} tokens a pass at that cost, "
        f"{need['tokens_a_pass_with_free_verification']:.2f} with verification free"
    )
