#!/usr/bin/env python3
"""What a sampled token tree keeps against a chain at equal verified tokens, on the demo pair.

    python tools/sampled_trees.py [--prompts 6] [--tokens 64] [--budgets 5,9]
                                  [--temperatures 1.0,0.5] [--top-ks 2,4] [--json]

Sampled decoding of held-out prompts (their first 96 tokens, then ``--tokens`` sampled, seed
5) with the small demo target and the demo draft on the emulated card: for each temperature
and budget N, every round a chain of N - 1 tokens, or a tree of N - 1 nodes drawn by the card
(DIST mode, up to top-k children a node, recursive rejection sampling over the siblings).
Reports tokens a round (rounds at the end of a sequence, with less room, may be chains).
Nothing is timed.
"""

from __future__ import annotations

import argparse
import json


def numbers(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts (default 6)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a prompt (default 64)")
    parser.add_argument("--budgets", default="5,9", help="verified tokens N (default 5,9)")
    parser.add_argument("--temperatures", default="1.0,0.5", help="default 1.0,0.5")
    parser.add_argument("--top-ks", default="2,4", help="tree children a node (default 2,4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from exstill_sdk import open_card
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.demo import POSITIONS, demo_dir, held_out_prompts
    from exstill_sdk.protocol.messages import TreeRequest
    from exstill_sdk.speculative import SamplingParams, SpeculativeDecoder

    data = demo_dir()
    prompts = held_out_prompts(args.prompts, 96)

    def tokens_a_round(temperature: float, n: int, top_k: int) -> float:
        target = OnnxTarget(
            data / "target.img", positions=POSITIONS, max_sequences=len(prompts), threads=1
        )
        tree = TreeRequest(n - 1, top_k, n - 1) if top_k > 1 else "off"
        with open_card(f"emu://?image={data / 'draft.img'}&context={POSITIONS}") as card:
            decoder = SpeculativeDecoder(
                card,
                target,
                draft=card.info().targets[0].name,
                sampling=SamplingParams(temperature=temperature, seed=5),
                k=n - 1,
                trees=tree,
            )
            results = decoder.generate_batch(prompts, args.tokens, stop_token_ids=[])
        made = sum(len(r.tokens) for r in results)
        return round(made / decoder.metrics.num_drafts, 3)

    rows = []
    for temperature in numbers(args.temperatures, float):
        for n in numbers(args.budgets, int):
            chain = tokens_a_round(temperature, n, 1)
            trees = {k: tokens_a_round(temperature, n, k) for k in numbers(args.top_ks, int)}
            best = max(trees.values())
            rows.append(
                {
                    "temperature": temperature,
                    "budget": n,
                    "chain": chain,
                    "trees": {f"top{k}": v for k, v in trees.items()},
                    "best_tree_over_chain": round(best / chain, 3),
                }
            )
    result = {"prompts": len(prompts), "tokens": args.tokens, "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"tokens a round, {len(prompts)} held-out prompts x {args.tokens} sampled tokens")
        for row in rows:
            trees = ", ".join(f"{k} {v}" for k, v in row["trees"].items())
            print(
                f"  T {row['temperature']}, N {row['budget']}: chain {row['chain']}, {trees}: "
                f"best tree {row['best_tree_over_chain']}x the chain"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
