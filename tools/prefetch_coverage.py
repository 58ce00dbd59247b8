#!/usr/bin/env python3
"""How many verification outcomes a card must draft ahead for to cover a share of rounds.

    python tools/prefetch_coverage.py [--prompts 6] [--rounds 24] [--k 8] [--json]

Greedy rounds of K on the demo pair over held-out prompts, the draft and the target both run
here (no card, nothing timed). For each round: the outcome that happened (j tokens accepted,
the target's token b after them), and the outcomes the card ranks first (firmware/outcomes.py,
``rank_outcomes``: the draft's own distributions at its image's rank temperature). A round is
covered with N outcomes when its outcome is full acceptance with the draft's guess (what the
card drafts ahead first) or among the N it ranks first. This is what MAX_WIDTH and the hit
rates of ``exstill-bench prefetch`` are read against.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

WIDTHS = (0, 2, 4, 8, 12, 16, 24, 32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts (default 6)")
    parser.add_argument("--rounds", type=int, default=24, help="rounds a prompt (default 24)")
    parser.add_argument("--k", type=int, default=8, help="draft length (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from exstill_firmware.outcomes import rank_outcomes

    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.demo import POSITIONS, demo_dir, held_out_prompts
    from exstill_sdk.image import open_image

    k = args.k
    with open_image(demo_dir() / "draft.img") as image:
        rank = image.rank_temperature
    target = OnnxTarget(demo_dir() / "target.img", positions=POSITIONS, threads=1)
    draft = OnnxTarget(demo_dir() / "draft.img", max_sequences=2, positions=POSITIONS, threads=1)
    ranks: list[int | None] = []  # where the outcome was ranked (-1: full with the guess)
    accepted: list[int] = []
    for prompt in held_out_prompts(args.prompts, 96):
        context = list(prompt)
        for _ in range(args.rounds):
            drafted = draft.greedy(context, k + 1, seq_id=1)
            logits = draft.verify(0, context, drafted[:k])  # rows after each drafted prefix
            best = target.verify(0, context, drafted[:k]).argmax(axis=-1).tolist()
            j = 0
            while j < k and best[j] == drafted[j]:
                j += 1
            outcome = (j, best[j])
            best_ranked = rank_outcomes(drafted, logits, max(WIDTHS), rank)
            ranked = [(o.accepted, o.bonus) for o in best_ranked]
            ranks.append(
                -1 if outcome == (k, drafted[k]) else ranked.index(outcome) if outcome in ranked
                else None
            )  # fmt: skip
            accepted.append(j)
            context += [*drafted[:j], best[j]]
            for model in (draft, target):
                model.release(0)
                model.release(1)
    covered = {
        n: round(sum(r is not None and r < n for r in ranks) / len(ranks), 3) for n in WIDTHS
    }
    result = {
        "k": k,
        "rounds": len(ranks),
        "mean_accepted": round(float(np.mean(accepted)), 3),
        "full_acceptance": round(float(np.mean([j == k for j in accepted])), 3),
        "covered_by_outcomes": covered,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['rounds']} rounds of K = {k}: {result['mean_accepted']} accepted on "
            f"average, all {k} in {result['full_acceptance']:.1%}"
        )
        for n, share in covered.items():
            print(f"  full acceptance with the guess + {n:2d} outcomes: {share:.1%} of rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
