"""exstill-bench's link benchmarks: a round's host cost and bytes (roundtrip), the host's
loop against context (host), flashing (flash)."""

from __future__ import annotations

import argparse
from typing import Any

from exstill_sdk.cli.support import Subcommands, comma_numbers


def register(sub: Subcommands) -> None:
    rt = sub.add_parser(
        "roundtrip",
        help="host cost and wire bytes of one verification round (COMMIT -> next draft)",
    )
    rt.add_argument("--url", default="emu://", help="card URL (default emu://)")
    rt.add_argument("--k", type=int, default=6, help="draft length per round (default 6)")
    rt.add_argument("--rounds", type=int, default=10000, help="timed rounds (default 10000)")
    rt.add_argument("--context", type=int, default=1000, help="stream context length")
    rt.add_argument(
        "--streams",
        type=int,
        default=1,
        help="also time a step of one round on each of N streams, sequential vs pipelined",
    )
    rt.add_argument(
        "--placement",
        choices=["cross-core", "same-core", "none"],
        default="cross-core",
        help="for a local tcp:// card server: pin it and the baseline echo server to one CPU "
        "and this client to another (cross-core, default) or the same one; none pins nothing",
    )
    rt.add_argument("--json", action="store_true", help="print one JSON object")
    rt.set_defaults(handler=_roundtrip)
    ho = sub.add_parser(
        "host",
        help="the host's own cost of a round (target and card time excluded) against context",
    )
    ho.add_argument(
        "--contexts", default="100,4000,16000", help="context lengths (default 100,4000,16000)"
    )
    ho.add_argument("--rounds", type=int, default=400, help="rounds per timed run (default 400)")
    ho.add_argument("--k", type=int, default=4, help="draft length (default 4)")
    ho.add_argument("--repeats", type=int, default=5, help="alternated repeats (default 5)")
    ho.add_argument("--json", action="store_true", help="print one JSON object")
    ho.set_defaults(handler=_host)
    fl = sub.add_parser("flash", help="upload speed and resumed-upload cost of exstill-flash")
    fl.add_argument("--url", required=True, help="a card with an image store")
    fl.add_argument("--size-mb", type=int, default=256, help="image size (default 256 MB)")
    fl.add_argument("--key", metavar="FILE", help="the card's admin key (tcp:// needs it)")
    fl.add_argument("--json", action="store_true", help="print one JSON object")
    fl.set_defaults(handler=_flash)


def _roundtrip(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.bench.link import roundtrip

    return roundtrip.run(args.url, args.k, args.rounds, args.context, args.placement, args.streams)


def _host(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.bench.link import host

    return host.run(comma_numbers("--contexts", args.contexts), args.rounds, args.k, args.repeats)


def _flash(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.bench.link import flash

    return flash.run(args.url, args.size_mb, args.key)
