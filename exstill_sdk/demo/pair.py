"""The demo pair shipped with the SDK (exstill_sdk/data/demo, made by tools/train_demo_pair.py):
a small target LLM trained on Python source and a draft distilled from it, as card images, with
the target's tokenizer."""

from __future__ import annotations

import json
import sysconfig
from importlib import resources
from pathlib import Path
from typing import Any

from exstill_sdk.errors import ExstillError, InvalidArgumentError

DRAFT_TARGET = "demo-draft"
POSITIONS = 2048
THREADS = 1
"""Compute threads of the demo target and of the emulated card: one core each, as a card brings
its own silicon; the target alone gets the same one core, so the comparison is like for like."""


def demo_dir() -> Path:
    path = Path(str(resources.files("exstill_sdk") / "data" / "demo"))
    if not (path / "target.img").exists():
        raise ExstillError(
            f"the demo pair is missing from {path}; reinstall exstill-sdk, or make it with "
            "python tools/train_demo_pair.py"
        )
    return path


def demo_tokenizer() -> Any:
    """The demo target's tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(demo_dir() / "tokenizer.json"))


def emulator_url() -> str:
    """The built-in (in-process) emulator with the demo draft loaded."""
    return f"emu://?context={POSITIONS}&threads={THREADS}&image={demo_dir() / 'draft.img'}"


def emulator_args(draft: Path | None = None) -> list[str]:
    """exstill-emu's arguments for a card with ``draft`` (default: the demo draft; see
    harness.card_process)."""
    return [
        "--context", str(POSITIONS), "--threads", str(THREADS),
        "--image", str(draft or demo_dir() / "draft.img"),
    ]  # fmt: skip


def draft_model(draft: Path | None = None) -> Any:
    """A draft image (default: the demo draft) as an OnnxTarget of one sequence: what the
    emulated card runs, run here to score a text teacher-forced."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.image.reader import open_image

    image = open_image(draft or demo_dir() / "draft.img")
    return OnnxTarget(image, max_sequences=1, positions=POSITIONS, threads=THREADS)


def held_out_prompts(count: int, prompt_tokens: int) -> list[list[int]]:
    """The first tokens of held-out stdlib files that exist on this machine."""
    data = demo_dir()
    tokenizer = demo_tokenizer()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for rel in json.loads((data / "training.json").read_text())["held_out_files"]:
        path = stdlib / rel
        if not path.exists():
            continue
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            return prompts
    raise InvalidArgumentError(
        f"found only {len(prompts)} held-out files of {prompt_tokens}+ tokens"
    )
