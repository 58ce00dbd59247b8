"""exstill-bench engine: the card's transformer engine against HF transformers."""

from __future__ import annotations

import argparse
from typing import Any

from exstill_sdk.cli.support import Subcommands, comma_numbers


def register(sub: Subcommands) -> None:
    en = sub.add_parser(
        "engine", help="per-token cost of the transformer engine vs HF transformers eager"
    )
    source = en.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="card image to benchmark")
    source.add_argument(
        "--synthetic", metavar="LAYERSxHIDDEN", help="a random Llama draft, e.g. 2x256"
    )
    en.add_argument("--k", type=int, default=8, help="tokens drafted per round (default 8)")
    en.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    en.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    en.add_argument(
        "--head",
        default="",
        metavar="N[,N...]",
        help="also time the same weights with a frequency-ranked head of N tokens",
    )
    en.add_argument("--json", action="store_true", help="print one JSON object")
    en.set_defaults(handler=_engine)


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.bench.engine import cost

    return cost.run(
        args.image,
        synthetic=args.synthetic,
        k=args.k,
        rounds=args.rounds,
        hf=not args.no_hf,
        heads=comma_numbers("--head", args.head) if args.head else (),
    )
