"""exstill-bench: benchmarks that print figures (``--json`` for one JSON object). Each group of
benchmarks registers its own sub-commands (bench/*/commands.py, plan/measure/commands.py)."""

from __future__ import annotations

import argparse
import sys

from exstill_sdk.bench.decode import commands as decode
from exstill_sdk.bench.engine import commands as engine
from exstill_sdk.bench.link import commands as link
from exstill_sdk.bench.vllm import commands as vllm
from exstill_sdk.cli.support import EXIT_OK, Parser, human_text, print_result, run
from exstill_sdk.plan.measure import commands as measure

GROUPS = (link, engine, decode, measure, vllm)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="exstill-bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("exstill-bench", args.json, lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    """A bench's handler returns its result, or None when it printed its own table."""
    result = args.handler(args)
    if result is not None:
        print_result(result, args.json, lambda: human_text(result))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
