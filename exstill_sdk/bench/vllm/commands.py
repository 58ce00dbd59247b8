"""exstill-bench vllm: the card against vLLM's own speculative methods."""

from __future__ import annotations

import argparse
import sys

from exstill_sdk.bench.vllm.side import WAY_NAMES
from exstill_sdk.cli.support import Subcommands, UsageError, comma_numbers, print_result
from exstill_sdk.demo.targets import TARGETS


def register(sub: Subcommands) -> None:
    vl = sub.add_parser(
        "vllm",
        help="the card against vLLM alone, vLLM's ngram and draft_model, same pair, same "
        "machine (run where vLLM is installed)",
    )
    vl.add_argument("--targets", default="large,small", help="demo targets (default large,small)")
    vl.add_argument("--users", default="1,4,12", help="user counts (default 1,4,12)")
    vl.add_argument(
        "--k",
        default="4,8",
        help="num_speculative_tokens: ngram and draft_model run at each, the card's ways at the "
        "largest (default 4,8)",
    )
    vl.add_argument("--new-tokens", type=int, default=128, help="tokens a request (default 128)")
    vl.add_argument(
        "--prompt-tokens", type=int, default=96, help="held-out prompt length (default 96)"
    )
    vl.add_argument("--repeats", type=int, default=2, help="timed runs per engine (default 2)")
    vl.add_argument(
        "--cycles",
        type=int,
        default=1,
        help="engine processes per way, the ways' order reversed each cycle (default 1)",
    )
    vl.add_argument(
        "--ways",
        default="all",
        help="comma list of " + ", ".join(WAY_NAMES) + " (default all; alone is needed)",
    )
    vl.add_argument("--json", action="store_true", help="print one JSON object")
    vl.set_defaults(handler=_vllm)


def _vllm(args: argparse.Namespace) -> None:
    from exstill_sdk.bench.vllm import side

    targets = tuple(t.strip() for t in args.targets.split(","))
    ways = WAY_NAMES if args.ways == "all" else tuple(w.strip() for w in args.ways.split(","))
    for name in targets:
        if name not in TARGETS:
            raise UsageError(f"--targets: {name!r} is not one of {', '.join(TARGETS)}")
    for way in ways:
        if way not in WAY_NAMES:
            raise UsageError(f"--ways: {way!r} is not one of {', '.join(WAY_NAMES)}")
    if min(args.new_tokens, args.prompt_tokens, args.repeats, args.cycles) < 1:
        raise UsageError("--new-tokens, --prompt-tokens, --repeats, --cycles want 1 or more")
    result = side.run(
        targets=targets,
        users=comma_numbers("--users", args.users),
        ks=comma_numbers("--k", args.k),
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        repeats=args.repeats,
        cycles=args.cycles,
        ways=ways,
        progress=not args.json and sys.stderr.isatty(),
    )
    print_result(result, args.json, lambda: side.table(result))
