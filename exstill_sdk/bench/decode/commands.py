"""exstill-bench's decoding benchmarks: plain against speculative decoding (spec), the demo
pair end to end, by target size and by users (e2e), token trees against chains (trees), one
user's shape chosen per round against chains only (shapes), a pool of cards against one (pool),
a soak of users on a pool whose cards restart (soak), and prefetch for several verification
outcomes against full acceptance only (prefetch)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from exstill_sdk.bench.decode.sizes import DEFAULT_SIZES
from exstill_sdk.bench.decode.trees import DEFAULT_BUDGETS
from exstill_sdk.cli.support import Subcommands, UsageError, comma_numbers, require_plotting


def _demo_target_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        choices=("large", "small"),
        default="large",
        help="demo target (default large, built into ~/.cache/exstill on first use)",
    )


def register(sub: Subcommands) -> None:
    sp = sub.add_parser(
        "spec", help="speculative vs plain decoding with the ONNX target; fixed vs adaptive K"
    )
    target = sp.add_mutually_exclusive_group(required=True)
    target.add_argument("--image", help="card image to run as the target")
    target.add_argument("--synthetic", metavar="LAYERSxHIDDEN", help="a random Llama target")
    sp.add_argument("--draft-image", help="draft with this image on the card (default: lookup)")
    sp.add_argument("--new-tokens", type=int, default=128, help="tokens to generate")
    sp.add_argument("--repeats", type=int, default=2, help="runs per configuration (best kept)")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(handler=_spec)
    e2e = sub.add_parser(
        "e2e",
        help="the demo pair on held-out prompts: plain vs speculative, K sweep, users, and HF "
        "assisted generation side by side",
    )
    e2e.add_argument("--prompts", type=int, default=3, help="held-out prompts (default 3)")
    e2e.add_argument("--prompt-tokens", type=int, default=96, help="tokens per prompt")
    e2e.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    e2e.add_argument("--max-k", type=int, default=8, help="sweep K = 1..MAX_K (default 8)")
    e2e.add_argument(
        "--users",
        default="1,2,4,8,12,16",
        help="the users curve on the large demo target: user counts (default 1,2,4,8,12,16; "
        "'none' skips it)",
    )
    e2e.add_argument(
        "--users-k",
        default="1,2,3,4,6,8",
        help="fixed K compared with adaptive K at every user count (default 1,2,3,4,6,8)",
    )
    e2e.add_argument(
        "--users-repeats",
        type=int,
        default=2,
        help="alternated runs of each way per user count (default 2)",
    )
    e2e.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    e2e.add_argument(
        "--sizes",
        default=",".join(DEFAULT_SIZES),
        help="targets for the size sweep: small, large or a hidden size to expand the demo "
        f"target to (default {','.join(DEFAULT_SIZES)}: 4.2M, 20M, 107M, 404M parameters; "
        "built into ~/.cache/exstill on first use); 'none' skips the sweep",
    )
    e2e.add_argument(
        "--size-runs", type=int, default=2, help="timed runs of each way per size (default 2)"
    )
    e2e.add_argument("--plot", metavar="DIR", help="also write PNG plots into DIR (matplotlib)")
    e2e.add_argument("--json", action="store_true", help="print one JSON object")
    e2e.set_defaults(handler=_e2e)
    trees = sub.add_parser(
        "trees",
        help="token trees against chains at equal verified tokens: tokens kept a pass, demo "
        "pair, rounds in held-out text (nothing timed)",
    )
    trees.add_argument("--files", type=int, default=3, help="held-out files (default 3)")
    trees.add_argument(
        "--context-tokens", type=int, default=96, help="text before the first round (default 96)"
    )
    trees.add_argument(
        "--rounds", type=int, default=32, help="rounds per file, one a position (default 32)"
    )
    trees.add_argument(
        "--budgets",
        default=",".join(str(b) for b in DEFAULT_BUDGETS),
        help="positions a pass scores: N - 1 drafted tokens as a chain or a tree (default "
        f"{','.join(str(b) for b in DEFAULT_BUDGETS)})",
    )
    trees.add_argument(
        "--target",
        choices=("large", "small", "none"),
        default="large",
        help="also time each budget's pass on this demo target and choose the shape for it "
        "(default large, built into ~/.cache/exstill on first use; none: acceptance only)",
    )
    trees.add_argument("--json", action="store_true", help="print one JSON object")
    trees.set_defaults(handler=_trees)
    shapes = sub.add_parser(
        "shapes",
        help="one user on a demo target with the emulated card: chains only against the shape "
        "chosen per round (trees where they pay), beside fixed chains and trees",
    )
    _demo_target_option(shapes)
    shapes.add_argument(
        "--prompts",
        type=int,
        default=1,
        help="held-out prompts, then the demo's (default 1: the first held-out prompt, one the "
        "draft takes almost whole)",
    )
    shapes.add_argument("--new-tokens", type=int, default=128, help="tokens a prompt (default 128)")
    shapes.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    shapes.add_argument(
        "--users",
        help="instead: the users curve with shapes at these user counts (e.g. 1,2,4,8): the "
        "adaptive chain, auto and each fixed tree",
    )
    shapes.add_argument("--json", action="store_true", help="print one JSON object")
    shapes.set_defaults(handler=_shapes)
    policy = sub.add_parser(
        "policy",
        help="K policies replayed on real texts: the adaptive policy against every fixed K, "
        "from each prompt's acceptance record and the pair's measured round costs",
    )
    _demo_target_option(policy)
    policy.add_argument(
        "--prompts", type=int, default=3, help="held-out prompts, then the demo's (default 3)"
    )
    policy.add_argument("--new-tokens", type=int, default=128, help="tokens a prompt (default 128)")
    policy.add_argument(
        "--records",
        metavar="FILE",
        help="replay the records and costs of an earlier run's --json output (nothing measured)",
    )
    policy.add_argument("--json", action="store_true", help="print one JSON object")
    policy.set_defaults(handler=_policy)
    pool = sub.add_parser(
        "pool",
        help="users on a pool of emulated demo cards against one card: decode tokens/s, exact "
        "output checked",
    )
    pool.add_argument("--users", type=int, default=24, help="users at once (default 24)")
    pool.add_argument("--cards", type=int, default=2, help="cards in the pool (default 2)")
    pool.add_argument("--new-tokens", type=int, default=96, help="tokens a user (default 96)")
    pool.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    pool.add_argument("--json", action="store_true", help="print one JSON object")
    pool.set_defaults(handler=_pool)
    soak = sub.add_parser(
        "soak",
        help="users coming and going on a pool of emulated cards for minutes, a card killed and "
        "restarted now and then: wrong tokens, failed requests, RSS, files and streams",
    )
    soak.add_argument("--minutes", type=float, default=30.0, help="how long (default 30)")
    soak.add_argument("--users", type=int, default=24, help="users at once (default 24)")
    soak.add_argument("--cards", type=int, default=2, help="emulated cards (default 2)")
    soak.add_argument("--streams", type=int, default=12, help="streams a card (default 12)")
    soak.add_argument(
        "--restart-every",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="kill a card and start it again about this often (default 300)",
    )
    soak.add_argument(
        "--max-new-tokens", type=int, default=200, help="longest answer (default 200)"
    )
    soak.add_argument("--json", action="store_true", help="print one JSON object")
    soak.set_defaults(handler=_soak)
    ahead = sub.add_parser(
        "prefetch",
        help="the card drafting ahead for several verification outcomes against full "
        "acceptance only: hit rate, reply times, the link's floor",
    )
    ahead.add_argument(
        "--target",
        default="large",
        help="demo target: small, large, or a hidden size to expand it to (default large; "
        "built into ~/.cache/exstill on first use)",
    )
    ahead.add_argument("--k", type=int, default=8, help="draft length every round (default 8)")
    ahead.add_argument("--prompts", type=int, default=3, help="held-out prompts (default 3)")
    ahead.add_argument("--new-tokens", type=int, default=96, help="tokens a prompt (default 96)")
    ahead.add_argument("--repeats", type=int, default=2, help="alternating runs (default 2)")
    ahead.add_argument("--json", action="store_true", help="print one JSON object")
    ahead.set_defaults(handler=_prefetch)


def _sizes(text: str, option: str = "--sizes") -> tuple[str, ...]:
    if text == "none":
        return ()
    sizes = tuple(s.strip() for s in text.split(","))
    for size in sizes:
        if size not in ("small", "large") and not (size.isdigit() and int(size) >= 256):
            raise UsageError(
                f"{option}: {size!r} is not small, large or a hidden size of 256 or more"
            )
    return sizes


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.bench.decode import spec

    return spec.run(
        args.image,
        synthetic=args.synthetic,
        draft_image=args.draft_image,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
    )


def _e2e(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.bench.decode import e2e

    if args.users_repeats < 1:
        raise UsageError("--users-repeats wants 1 or more")
    if args.plot:
        require_plotting("--plot")
    result = e2e.run(
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        ks=tuple(range(1, args.max_k + 1)),
        users=() if args.users == "none" else comma_numbers("--users", args.users),
        users_ks=comma_numbers("--users-k", args.users_k),
        users_repeats=args.users_repeats,
        hf=not args.no_hf,
        sizes=_sizes(args.sizes),
        size_runs=args.size_runs,
        progress=not args.json and sys.stderr.isatty(),
    )
    if args.plot:
        from exstill_sdk.bench.decode.plots import plot_e2e

        result["plots"] = [str(p) for p in plot_e2e(result, args.plot)]
    return result


def _trees(args: argparse.Namespace) -> dict[str, Any] | None:
    from exstill_sdk.bench.decode import trees

    budgets = comma_numbers("--budgets", args.budgets)
    if min(budgets) < 2:
        raise UsageError("--budgets wants 2 or more: a pass scores the drafted tokens and one more")
    if min(args.files, args.context_tokens, args.rounds) < 1:
        raise UsageError("--files, --context-tokens and --rounds want 1 or more")
    result = trees.run(
        files=args.files,
        context_tokens=args.context_tokens,
        rounds=args.rounds,
        budgets=budgets,
        timed_on=None if args.target == "none" else args.target,
    )
    if args.json:
        return result
    print(trees.table(result))
    return None


def _prefetch(args: argparse.Namespace) -> dict[str, Any] | None:
    from exstill_sdk.bench.decode import prefetch

    if len(_sizes(args.target, "--target")) != 1:
        raise UsageError("--target takes one demo target: small, large or a hidden size")
    if min(args.k, args.prompts, args.new_tokens, args.repeats) < 1:
        raise UsageError("--k, --prompts, --new-tokens and --repeats want 1 or more")
    result = prefetch.run(
        args.target,
        k=args.k,
        prompts=args.prompts,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        progress=not args.json,
    )
    if args.json:
        return result
    print(prefetch.table(result))
    return None


def _pool(args: argparse.Namespace) -> dict[str, Any] | None:
    from exstill_sdk.bench.decode import pool

    if min(args.users, args.new_tokens, args.repeats) < 1 or args.cards < 2:
        raise UsageError("--users, --new-tokens and --repeats want 1 or more, --cards 2 or more")
    result = pool.run(
        users=args.users,
        cards=args.cards,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        progress=not args.json,
    )
    if args.json:
        return result
    print(pool.table(result))
    return None


def _soak(args: argparse.Namespace) -> dict[str, Any] | None:
    from exstill_sdk.bench.decode import soak

    if min(args.users, args.cards, args.streams) < 1 or args.max_new_tokens < 8:
        raise UsageError("--users, --cards and --streams want 1 or more, --max-new-tokens 8+")
    if args.minutes <= 0 or args.restart_every <= 0:
        raise UsageError("--minutes and --restart-every want a time above 0")
    result = soak.run(
        minutes=args.minutes,
        users=args.users,
        cards=args.cards,
        streams=args.streams,
        restart_every=args.restart_every,
        max_new_tokens=args.max_new_tokens,
        progress=not args.json,
    )
    if args.json:
        return result
    print(soak.table(result))
    return None


def _policy(args: argparse.Namespace) -> dict[str, Any] | None:
    import json

    from exstill_sdk.bench.decode import policy

    if args.records:
        try:
            with open(args.records, encoding="utf-8") as f:
                record = json.load(f)["record"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(
                f"--records {args.records}: not an `exstill-bench policy --json` output ({exc})"
            ) from None
    else:
        if args.new_tokens < 2 or args.prompts < 0:
            raise UsageError("--new-tokens wants 2 or more, --prompts 0 or more")
        record = policy.measure(
            target=args.target, prompts=args.prompts, new_tokens=args.new_tokens
        )
    result = policy.replay_all(record)
    if args.json:
        return {"record": record, "replayed": result}
    print(policy.table(record, result))
    return None


def _shapes(args: argparse.Namespace) -> dict[str, Any] | None:
    from exstill_sdk.bench.decode import shapes

    if min(args.new_tokens, args.repeats) < 1 or args.prompts < 0:
        raise UsageError("--new-tokens and --repeats want 1 or more, --prompts 0 or more")
    if args.users:
        result = shapes.users_run(
            target=args.target,
            users=comma_numbers("--users", args.users),
            new_tokens=args.new_tokens,
            repeats=args.repeats,
        )
        table = shapes.users_table
    else:
        result = shapes.run(
            target=args.target,
            prompts=args.prompts,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
        )
        table = shapes.table
    if args.json:
        return result
    print(table(result))
    return None
