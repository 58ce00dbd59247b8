"""``exstill eval``: a draft's tokens kept per verification pass, per kind of task."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from exstill_sdk.cli.support import EXIT_OK, require_plotting


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help="measure drafts on the target's own greedy text: tokens kept per verification "
        "pass at K = 1..8, per prompt category",
        description="The target (an HF checkpoint directory or a GGUF file, run by "
        "transformers on the CPU) continues each prompt greedily; each draft image, and prompt "
        "lookup, is scored along that text: mean tokens kept per verification pass (tau) at "
        "every K, acceptance at each draft depth, and the draft's top-k coverage of the "
        "target's token (what a tree could keep). Prompts: the SDK's held-out set (200, in "
        "chat, code, math, rewriting and long context) unless --prompts is given.",
    )
    p.add_argument("--target", required=True, help="HF checkpoint directory or GGUF file")
    p.add_argument("--draft", action="append", default=[], help="a draft card image (repeatable)")
    p.add_argument("--prompts", help="JSONL of {category, prompt}, or text: one prompt a line")
    p.add_argument("--limit", type=int, help="the first N prompts of each category only")
    p.add_argument("--max-k", type=int, default=8, help="largest draft length (default 8)")
    p.add_argument(
        "--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)"
    )
    p.add_argument("--no-lookup", action="store_true", help="leave prompt lookup out")
    p.add_argument(
        "--trees",
        metavar="N,N,...",
        help="also each draft's card-grown trees of N - 1 nodes (top-2 and top-4 children) "
        "against its chain of N - 1 tokens, at these budgets N (positions a pass scores; "
        "e.g. 8,16,32,64)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where torch runs the target and the drafts: cpu (default), cuda, cuda:N or auto",
    )
    p.add_argument("--plot", metavar="DIR", help="also write eval_tau.png into DIR")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


TABLE_WIDTHS = ("2", "4", "8")
"""The coverage widths the table shows (the JSON has every width from 1 to 8)."""


def _table(report: dict[str, Any]) -> str:
    ks = [str(k) for k in range(1, report["max_k"] + 1)]
    lines = [
        f"tokens kept per verification pass (tau; 1.0 = the target alone), {report['prompts']} "
        f"prompts, {report['new_tokens']} greedy tokens each",
        f"{'draft':<18} {'category':<13} {'prompts':>7} " + " ".join(f"{'K=' + k:>6}" for k in ks),
    ]
    for name, groups in report["drafters"].items():
        for group, row in groups.items():
            taus = " ".join(f"{row['tau'][k]:>6.2f}" for k in ks)
            lines.append(f"{name[:18]:<18} {group:<13} {row['prompts']:>7} {taus}")
    lines.append("acceptance by draft depth at K=" + ks[-1] + " (all prompts):")
    for name, groups in report["drafters"].items():
        row = groups["all"]
        depth = " ".join(f"{a:.2f}" for a in row["acceptance_by_depth"])
        lines.append(f"  {name[:18]:<18} {depth}")
        if "head_coverage" in row:
            lines.append(
                f"  {'':<18} {row['head_coverage']:.3f} of the target's tokens are in the "
                "draft's head"
            )
        for width, shares in row.get("coverage_by_depth", {}).items():
            if width in TABLE_WIDTHS:
                cover = " ".join(f"{c:.2f}" for c in shares)
                lines.append(f"  {'':<18} {cover}  (target token in the draft's top {width})")
    for name, cal in report.get("calibration", {}).items():
        if cal["rank_temperature_fit"] is not None:
            lines.append(
                f"{name[:18]}: ranks tree nodes and outcomes at temperature "
                f"{cal['rank_temperature']}; these prompts calibrate it at "
                f"{cal['rank_temperature_fit']} ({cal['positions']} positions; exstill-pack "
                "--rank-temperature)"
            )
    for name, groups in report["drafters"].items():
        if "trees" in groups["all"]:
            lines.append(f"{name[:18]}: tokens kept a pass at equal verified tokens N")
            for group, row in groups.items():
                for n, shapes in row["trees"].items():
                    cells = "  ".join(
                        f"{s} {v:.2f}" for s, v in shapes.items() if s.startswith("top")
                    )
                    lines.append(
                        f"  {group:<13} N={n:<3} chain {shapes['chain']:.2f}  {cells}  "
                        f"(best tree {shapes['best_over_chain']:.2f}x the chain)"
                    )
    return "\n".join(lines)


def _plot(report: dict[str, Any], directory: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    groups = list(next(iter(report["drafters"].values())))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.2), sharey=True)
    axes = axes if len(groups) > 1 else [axes]
    ks = list(range(1, report["max_k"] + 1))
    for ax, group in zip(axes, groups, strict=True):
        for name, by_group in report["drafters"].items():
            ax.plot(ks, [by_group[group]["tau"][str(k)] for k in ks], marker="o", label=name)
        ax.set_title(group)
        ax.set_xlabel("K")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens kept per pass")
    axes[-1].legend(fontsize="small")
    fig.tight_layout()
    path = directory / "eval_tau.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_eval(args: argparse.Namespace) -> int:
    from exstill_sdk.cli.support import UsageError, comma_numbers
    from exstill_sdk.evaluation.prompts import load_prompts
    from exstill_sdk.evaluation.run import evaluate

    if args.plot:
        require_plotting("--plot")
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be 1 or more")
    if args.new_tokens < 2:
        raise UsageError("--new-tokens must be 2 or more")
    prompts = load_prompts(args.prompts)
    if args.limit:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= args.limit:
                kept.append(p)
        prompts = kept

    def progress(done: int, total: int) -> None:
        if not args.json and sys.stderr.isatty():
            print(f"\rexstill eval: {done}/{total} prompts", end="", file=sys.stderr, flush=True)

    report = evaluate(
        args.target,
        args.draft,
        prompts,
        max_k=args.max_k,
        new_tokens=args.new_tokens,
        lookup=not args.no_lookup,
        trees=comma_numbers("--trees", args.trees) if args.trees else (),
        device=args.device,
        progress=progress,
    )
    if not args.json and sys.stderr.isatty():
        print(file=sys.stderr)
    if args.plot:
        report["plot"] = str(_plot(report, Path(args.plot)))
    print(json.dumps(report) if args.json else _table(report))
    return EXIT_OK
