"""``exstill distill``: make a draft for a target from the target's own outputs, and pack it."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from exstill_sdk.cli.support import EXIT_OK, UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "distill",
        help="make a draft for a target (an HF checkpoint or a GGUF file) from its own answers",
        description="The target answers prompts (yours, or ones it writes itself), greedy and "
        "sampled; a draft made of the target's embedding, head and a few of its layers is "
        "trained to agree with the target's distribution on those answers, then packed as a "
        "card image in the target's tokenizer. Resumable: Ctrl-C, then the same command again "
        "continues. docs/distilling.md.",
    )
    p.add_argument("target", help="HF checkpoint directory or GGUF file")
    p.add_argument("-o", "--output", required=True, help="the draft image to write")
    p.add_argument("--name", help="target name in the image (default: the target's file name)")
    p.add_argument("--prompts", help="JSONL of {category, prompt}, or text: one prompt a line")
    p.add_argument("--examples", type=int, default=1600, help="prompts to answer (default 1600)")
    p.add_argument("--layers", type=int, default=4, help="the draft's layers (default 4)")
    p.add_argument("--answer-tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument(
        "--minutes", type=float, default=60.0, help="time budget of the run (default 60)"
    )
    p.add_argument(
        "--steps", type=int, help="stop training after this many steps in all (default: the time)"
    )
    p.add_argument("--dtype", choices=["f32", "f16", "int8"], default="f16", help="image dtype")
    p.add_argument(
        "--head",
        type=int,
        help="tokens the draft may propose, the target's most frequent (a frequency-ranked "
        "head; default 16384 for a vocabulary of 16384 or more, else the whole; 0: the whole)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where torch runs the target and the draft: auto (a CUDA GPU where torch sees "
        "one, else the CPU), cpu, cuda or cuda:N (default auto)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="where the run's state lives (default: under ~/.cache)")
    p.add_argument("--restart", action="store_true", help="discard the work dir's earlier run")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _work_dir(args: argparse.Namespace) -> Path:
    if args.work_dir:
        return Path(args.work_dir)
    key = hashlib.sha256(str(Path(args.target).resolve()).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "exstill" / "distill" / f"{Path(args.target).stem}-{key}"


def run_distill(args: argparse.Namespace) -> int:
    from exstill_sdk.distill.run import DistillOptions, distill

    for option, value in (
        ("--examples", args.examples),
        ("--layers", args.layers),
        ("--answer-tokens", args.answer_tokens),
        ("--steps", 1 if args.steps is None else args.steps),
    ):
        if value < 1:
            raise UsageError(f"{option} must be 1 or more")
    work = _work_dir(args)
    if args.restart and work.exists():
        shutil.rmtree(work)
    options = DistillOptions(
        target=str(Path(args.target).resolve()),
        prompts=str(Path(args.prompts).resolve()) if args.prompts else None,
        examples=args.examples,
        layers=args.layers,
        answer_tokens=args.answer_tokens,
        seed=args.seed,
    )
    bars: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if args.json or not sys.stderr.isatty():
            return
        from tqdm import tqdm

        bar = bars.get(stage)
        if bar is None:
            unit = "s" if stage == "training" else "batch"
            bar = bars[stage] = tqdm(total=total, desc=stage, unit=unit, leave=False)
        bar.update(done - bar.n)

    try:
        result = distill(
            options,
            args.output,
            name=args.name or Path(args.target).stem,
            work_dir=work,
            minutes=args.minutes,
            max_steps=args.steps,
            dtype=args.dtype,
            head=args.head,
            device=args.device,
            progress=progress,
        )
    except KeyboardInterrupt:
        print(f"exstill distill: stopped; the same command continues from {work}", file=sys.stderr)
        raise
    finally:
        for bar in bars.values():
            bar.close()
    report = asdict(result)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{result.image}: {result.steps} steps on {result.examples} answers on {result.device} "
            f"({result.train_seconds:.0f} s of training); the draft's top token is the "
            f"target's at {result.agreement_after:.1%} of held-out positions "
            f"({result.agreement_before:.1%} before training; {result.train_agreement_after:.1%} "
            "of training positions)"
        )
        if result.head_coverage is not None:
            print(
                f"its head holds {result.head_size} tokens, {result.head_coverage:.1%} of the "
                "target's held-out answer tokens"
            )
        if result.rank_temperature is not None:
            print(
                f"its probabilities are calibrated at temperature {result.rank_temperature} "
                "(packed: the card ranks tree nodes and outcomes by them)"
            )
    return EXIT_OK
