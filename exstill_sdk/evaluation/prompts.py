"""Prompt sets for measuring a draft, by category.

The SDK ships a held-out set written for the project (``exstill_sdk/data/prompts/
heldout.jsonl``): 200 prompts, 40 in each of chat, code, math, rewriting and long context
(passages of 1,800 to 4,400 characters with a question after them; four of the passages are
sections of this project's docs). A user's own set is a JSONL file of
``{"category": ..., "prompt": ...}`` objects (category optional) or a text file of one prompt
a line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from exstill_sdk.errors import InvalidArgumentError

HELDOUT = "heldout.jsonl"
CATEGORIES = ("chat", "code", "math", "rewriting", "long_context")


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


def _parse_jsonl(lines: list[str], where: str) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{where}, line {number}: not JSON ({exc.msg})") from None
        text = entry.get("prompt") if isinstance(entry, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgumentError(
                f'{where}, line {number}: each line must be {{"category": ..., "prompt": TEXT}}'
            )
        prompts.append(Prompt(str(entry.get("category") or "prompts"), text))
    return prompts


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The prompts of a JSONL or text file; the shipped held-out set when ``path`` is None."""
    if path is None:
        text = resources.files("exstill_sdk").joinpath(f"data/prompts/{HELDOUT}").read_text("utf-8")
        return _parse_jsonl(text.splitlines(), HELDOUT)
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read prompts from {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{p} is not UTF-8 text") from None
    lines = text.splitlines()
    if p.suffix == ".jsonl":
        prompts = _parse_jsonl(lines, str(p))
    else:
        prompts = [Prompt("prompts", line) for line in lines if line.strip()]
    if not prompts:
        raise InvalidArgumentError(f"{p} holds no prompts")
    return prompts
