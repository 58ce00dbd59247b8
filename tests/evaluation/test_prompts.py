from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from exstill_sdk import InvalidArgumentError
from exstill_sdk.evaluation.prompts import CATEGORIES, load_prompts


def test_the_shipped_held_out_set() -> None:
    prompts = load_prompts()
    assert Counter(p.category for p in prompts) == {c: 40 for c in CATEGORIES}
    assert len({p.text for p in prompts}) == 200
    long = [p for p in prompts if p.category == "long_context"]
    assert min(len(p.text) for p in long) > 1500


def test_user_prompt_files(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in load_prompts(text)] == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"category": "code", "prompt": "def f():"}\n{"prompt": "hello"}\n')
    assert [(p.category, p.text) for p in load_prompts(jsonl)] == [
        ("code", "def f():"),
        ("prompts", "hello"),
    ]


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"prompt": "a"}\nnot json\n', "line 2: not JSON"),
        ('{"category": "x"}\n', "line 1: each line must be"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match=message):
        load_prompts(path)
    with pytest.raises(InvalidArgumentError, match="cannot read prompts"):
        load_prompts(tmp_path / "missing.jsonl")
