"""exstill-bench: benchmarks that print figures (``--json`` for one JSON object)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from exstill_sdk.bench.sizes import DEFAULT_SIZES
from exstill_sdk.bench.vllm_side import WAY_NAMES
from exstill_sdk.cli.support import (
    EXIT_OK,
    Parser,
    UsageError,
    comma_numbers,
    human_text,
    print_result,
    run,
)
from exstill_sdk.demo.targets import TARGETS


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="exstill-bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)
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
    en.add_argument("--json", action="store_true", help="print one JSON object")
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
    fl = sub.add_parser("flash", help="upload speed and resumed-upload cost of exstill-flash")
    fl.add_argument("--url", required=True, help="a card with an image store")
    fl.add_argument("--size-mb", type=int, default=256, help="image size (default 256 MB)")
    fl.add_argument("--key", metavar="FILE", help="the card's admin key (tcp:// needs it)")
    fl.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _sizes(text: str) -> tuple[str, ...]:
    if text == "none":
        return ()
    sizes = tuple(s.strip() for s in text.split(","))
    for size in sizes:
        if size not in ("small", "large") and not (size.isdigit() and int(size) >= 256):
            raise UsageError(
                f"--sizes: {size!r} is not small, large or a hidden size of 256 or more"
            )
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("exstill-bench", args.json, lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    result: dict[str, Any]
    if args.bench == "roundtrip":
        from exstill_sdk.bench import roundtrip

        result = roundtrip.run(
            args.url, args.k, args.rounds, args.context, args.placement, args.streams
        )
    elif args.bench == "engine":
        from exstill_sdk.bench import engine

        result = engine.run(
            args.image,
            synthetic=args.synthetic,
            k=args.k,
            rounds=args.rounds,
            hf=not args.no_hf,
        )
    elif args.bench == "e2e":
        from exstill_sdk.bench import e2e

        if args.users_repeats < 1:
            raise UsageError("--users-repeats wants 1 or more")

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
            from exstill_sdk.bench.plots import plot_e2e

            result["plots"] = [str(p) for p in plot_e2e(result, args.plot)]
    elif args.bench == "host":
        from exstill_sdk.bench import host

        result = host.run(
            comma_numbers("--contexts", args.contexts), args.rounds, args.k, args.repeats
        )
    elif args.bench == "profile":
        from exstill_sdk.bench import profile

        result = profile.run(
            args.target,
            comma_numbers("--users", args.users),
            adapter=args.adapter,
            out=args.out,
            progress=not args.json and sys.stderr.isatty(),
        )
    elif args.bench == "vllm":
        from exstill_sdk.bench import vllm_side

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
        result = vllm_side.run(
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
        print_result(result, args.json, lambda: vllm_side.table(result))
        return EXIT_OK
    elif args.bench == "flash":
        from exstill_sdk.bench import flash

        result = flash.run(args.url, args.size_mb, args.key)
    elif args.bench == "spec":
        from exstill_sdk.bench import spec

        result = spec.run(
            args.image,
            synthetic=args.synthetic,
            draft_image=args.draft_image,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
        )
    else:  # pragma: no cover - argparse rejects unknown choices
        raise AssertionError(args.bench)
    print_result(result, args.json, lambda: human_text(result))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
