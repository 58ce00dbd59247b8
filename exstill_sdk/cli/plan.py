"""``exstill plan``: what the card will do for a target, its GPUs and its users (the planner)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from exstill_sdk.cli.support import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    comma_numbers,
    print_result,
    require_plotting,
)

DEFAULT_USERS = "1,2,4,8,16"
CHECK_USERS = "1,4,8,16"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="project tokens/s and speed-up for a target, a card and users (the planner)",
        description="Simulates U users decoding through the card, round by round in virtual "
        "time, from three profiles: the target's pass costs, the card's drafting and link, and "
        "the acceptance of its drafts. Names of shipped profiles work in place of paths "
        "(docs/planning.md lists them and the schema).",
    )
    p.add_argument("--target", help="target profile (.toml/.json, or a shipped one's name)")
    p.add_argument("--card", default="exstill-x1", help="card profile (default exstill-x1)")
    p.add_argument(
        "--acceptance",
        help="acceptance profile, the JSON of a run (exstill demo --json, exstill-bench "
        "e2e --json, vLLM spec-decode counters), or exstill eval --json's report "
        "(REPORT#DRAFT or REPORT#DRAFT/CATEGORY)",
    )
    p.add_argument(
        "--users",
        help=f"user counts (default {DEFAULT_USERS}; with --check {CHECK_USERS})",
    )
    p.add_argument("--cards", type=int, help="cards (default: the card profile's)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--k", default="auto", help="auto (default: the best shape per row) or a chain of 0..max_k"
    )
    shape.add_argument("--tree", type=int, metavar="N", help="a tree of N nodes in every row")
    p.add_argument("--plot", metavar="DIR", help="also write plan_speedup.png into DIR")
    p.add_argument(
        "--check",
        action="store_true",
        help="measure the demo pair on this machine (both demo targets, the emulated card in "
        "its own process), predict the same runs from the measured profiles and print "
        "predicted against measured for every row (minutes)",
    )
    p.add_argument(
        "--seed",
        nargs="?",
        const="",
        metavar="SCENARIO",
        help="set the planner against the seed's published figures (its one-user speeds and "
        "Figure 4) from the seed's own inputs, with the difference at each point and what "
        "would close it (about a minute); SCENARIO: another file of points in the same form",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(args: argparse.Namespace) -> int:
    from exstill_sdk.plan import load_acceptance, load_card, load_target, plan

    if args.check:
        return _check(args)
    if args.seed is not None:
        return _seed(args)
    if args.target is None or args.acceptance is None:
        raise UsageError("give --target and --acceptance (or --check, or --seed)")
    users = comma_numbers("--users", args.users or DEFAULT_USERS)
    target = load_target(args.target)
    card = load_card(args.card)
    acceptance = load_acceptance(args.acceptance)
    if args.cards is not None:
        if args.cards < 1:
            raise UsageError(f"--cards wants 1 or more, not {args.cards}")
        card = card.with_cards(args.cards)
    shape = _shape(args, card, acceptance)
    if args.plot:
        require_plotting("--plot")
    rows = []
    for u in users:
        best, tried = plan(target, card, acceptance, u, shape)
        by_shape = {name: round(v, 1) for name, v in tried.items()}
        rows.append({**best.to_dict(), "tokens_per_s_by_shape": by_shape})
    result: dict[str, Any] = {
        "target": {"name": target.name, "source": target.source},
        "card": {"name": card.name, "cards": card.cards, "streams": card.streams},
        "acceptance": {
            "source": acceptance.source,
            "per_position": [round(acceptance.at(i), 4) for i in range(1, card.max_k + 1)],
            "rank_share": [round(v, 4) for v in acceptance.rank_share],
        },
        "shape": str(shape) if shape is not None else "auto",
        "rows": rows,
    }
    if args.plot:
        result["plots"] = [str(p) for p in _plot(result, Path(args.plot))]
    print_result(result, args.json, lambda: _table(result))
    return EXIT_OK


def _shape(args: argparse.Namespace, card: Any, acceptance: Any) -> Any:
    """The shape --k or --tree fixes, or None (the best per row)."""
    from exstill_sdk.plan.shapes import chain_shape, tree_shape

    if args.tree is not None:
        if not 1 <= args.tree <= card.max_tree_nodes:
            raise UsageError(f"--tree wants 1..{card.max_tree_nodes} nodes, not {args.tree}")
        if not acceptance.rank_share:
            raise UsageError(
                "--tree needs the acceptance of the draft's other choices: give top_k or "
                "tree_mean_length in the acceptance profile (docs/planning.md)"
            )
        return tree_shape(acceptance, args.tree)
    if args.k == "auto":
        return None
    try:
        k = int(args.k)
    except ValueError:
        raise UsageError(f"--k wants auto or 0..{card.max_k}, not {args.k!r}") from None
    if not 0 <= k <= card.max_k:
        raise UsageError(f"--k wants auto or 0..{card.max_k}, not {k}")
    return chain_shape(acceptance, k)


def _seed(args: argparse.Namespace) -> int:
    from exstill_sdk.plan import seed

    result = seed.compare(args.seed or seed.SCENARIO)
    print_result(result, args.json, lambda: _seed_table(result))
    return EXIT_OK


def _seed_table(result: dict[str, Any]) -> str:
    lines = [
        f"the seed's figures against the planner (card {result['card']}, acceptance: "
        f"{result['acceptance']})",
        f"{'figure':<20} {'target':<16} {'users':>5} {'seed':>8} {'planner':>8} {'diff':>7}  "
        f"{'shape':<12} {'verify/plain':>12}",
    ]
    for p in result["points"]:
        fmt = ".2f" if p["unit"] == "x" else ".0f"
        lines.append(
            f"{p['figure']:<20} {p['target']:<16} {p['users']:>5} {p['seed']:>8{fmt}} "
            f"{p['planner']:>8{fmt}} {p['difference']:>+7.1%}  {p['shape']:<12} "
            f"{p['verify_over_plain']:>12.2f}"
        )
        if "at_seed_shape" in p:
            at = p["at_seed_shape"]
            lines.append(
                f"{'':<20} at the seed's {at['shape']}: {at['speedup']:.2f}x "
                f"({at['difference']:+.1%})"
            )
        if "gap" in p:
            lines.append(f"{'':<20} gap: {p['gap']}")
    lines.append(
        f"{result['within']} of {len(result['points'])} points within "
        f"{result['tolerance']:.0%} (docs/planning.md: the seed's figures)"
    )
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> int:
    import sys

    from exstill_sdk.plan.measure import check as plan_check

    result = plan_check.run(
        users=comma_numbers("--users", args.users or CHECK_USERS), progress=sys.stderr.isatty()
    )
    print_result(result, args.json, lambda: _check_table(result))
    return EXIT_OK if result["ok"] else EXIT_FAILED


def _check_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'target':<7} {'users':>5} {'shape':<26} {'predicted':>10} {'measured':>10} "
        f"{'error':>7}   {'plain: predicted':>16} {'measured':>9}   speed-up: predicted measured"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['target']:<7} {r['users']:>5} {r['shape']:<26} "
            f"{r['predicted_tokens_per_s']:>10.1f} "
            f"{r['measured_tokens_per_s']:>10.1f} {r['error']:>+7.1%}   "
            f"{r['predicted_plain_tokens_per_s']:>16.1f} {r['measured_plain_tokens_per_s']:>9.1f}"
            f"   {r['predicted_speedup']:>8.2f}x {r['measured_speedup']:>7.2f}x"
        )
    verdict = "within" if result["ok"] else "NOT within"
    lines.append(
        f"largest error {result['max_abs_error']:.1%}: {verdict} {result['tolerance']:.0%} "
        "(speculative tokens/s while every user decodes, median of alternated runs)"
    )
    return "\n".join(lines)


def _table(result: dict[str, Any]) -> str:
    head = (
        f"target {result['target']['name']}, card {result['card']['name']} x "
        f"{result['card']['cards']}, acceptance from {result['acceptance']['source']}\n"
        f"{'users':>5} {'shape':<11} {'tok/s':>9} {'per user':>9} {'plain':>9} {'speed-up':>8} "
        f"{'accept':>6} {'ahead':>5} {'hits':>5} {'waves':>5}  "
        "round ms: step + verify extra + host + link + card"
    )
    lines = [head]
    for r in result["rows"]:
        ms = r["round_ms"]
        lines.append(
            f"{r['users']:>5} {r['shape']:<11} {r['tokens_per_s']:>9.1f} "
            f"{r['tokens_per_s_per_user']:>9.1f} {r['plain_tokens_per_s']:>9.1f} "
            f"{r['speedup']:>7.2f}x {r['mean_acceptance_length']:>6.2f} "
            f"{r['outcomes_ahead']:>5.1f} {r['prefetch_hit_rate']:>5.0%} {r['waves']:>5}  "
            f"{ms['step']:.2f} + {ms['verify_extra']:.2f} + {ms['host']:.3f} + "
            f"{ms['link']:.3f} + {ms['card']:.3f}"
        )
    return "\n".join(lines)


def _plot(result: dict[str, Any], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    users = [r["users"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(users, [r["speedup"] for r in rows], "o-", label=f"card, shape {result['shape']}")
    for u, r in zip(users, rows, strict=True):
        ax.annotate(r["shape"], (u, r["speedup"]), textcoords="offset points", xytext=(0, 6))
    ax.axhline(1.0, color="grey", linewidth=0.8, label="plain batching")
    ax.set_xticks(users)
    ax.set(
        xlabel="users",
        ylabel="speed-up over plain decoding",
        title=f"{result['target']['name']}: planned speed-up",
    )
    ax.legend()
    fig.tight_layout()
    path = directory / "plan_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
