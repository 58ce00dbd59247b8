"""exstill-bench profile: the planner's profiles of this machine."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from exstill_sdk.cli.support import Subcommands, comma_numbers


def register(sub: Subcommands) -> None:
    pr = sub.add_parser(
        "profile",
        help="measure planner profiles on this machine: a demo target's passes, the emulated "
        "card's drafting and link, the host's loop, and acceptance runs (exstill plan reads them)",
    )
    pr.add_argument("--target", choices=("small", "large"), default="large", help="demo target")
    pr.add_argument(
        "--adapter",
        choices=("onnx", "hf"),
        default="onnx",
        help="onnx (default): OnnxTarget, every sequence in one pass; hf: HFTarget on "
        "transformers (the hf extra), a forward call per sequence",
    )
    pr.add_argument("--users", default="1,4,8,16", help="user counts (default 1,4,8,16)")
    pr.add_argument(
        "--out", metavar="DIR", help="also write target.json, card.json and run-U-users.json"
    )
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.set_defaults(handler=_profile)


def _profile(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.plan.measure import profile

    return profile.run(
        args.target,
        comma_numbers("--users", args.users),
        adapter=args.adapter,
        out=args.out,
        progress=not args.json and sys.stderr.isatty(),
    )
