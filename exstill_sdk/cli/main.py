"""exstill: the SDK's front door. ``exstill demo`` shows the product doing its job."""

from __future__ import annotations

import argparse
import json
import sys

from exstill_sdk.errors import ExstillError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exstill", description="Exstill draft card SDK.")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="speculative decoding with the shipped demo pair, against the target alone",
        description="A small target LLM (trained on Python source) runs on this CPU; its draft "
        "runs on a card (the built-in emulator unless --url is given). Streams the text, then "
        "compares tokens/s with the target alone and checks the output is identical.",
    )
    demo.add_argument("--prompt", help="text to continue (default: the start of a function)")
    demo.add_argument("--url", help="a card with the demo draft flashed (default: emulator)")
    demo.add_argument("--max-new-tokens", type=int, default=200, help="default 200")
    demo.add_argument("--k", default="adaptive", help="draft length 1..8 or 'adaptive'")
    demo.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    return p


def _demo(args: argparse.Namespace) -> int:
    from exstill_sdk.demo import DEFAULT_PROMPT, run_demo

    k = args.k if args.k == "adaptive" else int(args.k)
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if not args.json:
        sys.stdout.write(prompt)
        sys.stdout.flush()

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = run_demo(
        prompt,
        url=args.url,
        max_new_tokens=args.max_new_tokens,
        k=k,
        on_text=None if args.json else show,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        per_pos = " ".join(f"{a:.2f}" for a in result.acceptance_per_position)
        chosen = ", ".join(f"K={k}: {n}" for k, n in sorted(result.k_chosen.items()))
        print(
            "\n\n"
            f"speculative  {result.spec_tokens_per_s:8.1f} tokens/s\n"
            f"target alone {result.plain_tokens_per_s:8.1f} tokens/s   "
            f"speedup {result.speedup:.2f}x\n"
            f"identical output: {'yes' if result.identical else 'NO'} "
            f"({result.new_tokens} tokens)\n"
            f"mean acceptance length {result.mean_acceptance_length:.2f} "
            f"over {result.rounds} rounds\n"
            f"acceptance by position {per_pos}\n"
            f"prefetch hits {result.prefetch_hits} of {result.rounds}\n"
            f"K chosen      {chosen}"
        )
    return 0 if result.identical else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _demo(args)
    except (ExstillError, ValueError) as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "code": getattr(exc, "code", None)}))
        else:
            print(f"exstill {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
