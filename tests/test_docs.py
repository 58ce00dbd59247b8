"""Docs that are code: the worked examples in docs/protocol.md are real frames (every one
decodes, its CRC checks, its stated size is right, and its COBS form is what the code sends),
and README's tour runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exstill_sdk.protocol import schema
from exstill_sdk.protocol.frame import decode_frame
from exstill_sdk.protocol.framing import encode_stream_frame

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
LINE = re.compile(r"^\s+(frame|cobs) \((\d+) bytes\): ([0-9a-f ]+)$")


def test_protocol_examples() -> None:
    examples = [LINE.match(line) for line in DOC.read_text().splitlines()]
    examples = [m for m in examples if m]
    assert len(examples) >= 14
    last_frame = None
    for match in examples:
        kind, size, text = match.group(1), int(match.group(2)), bytes.fromhex(match.group(3))
        assert len(text) == size, match.group(0)
        if kind == "frame":
            decode_frame(text)  # raises on a bad CRC or length
            assert "payload_error" not in schema.describe_frame(text), match.group(0)
            last_frame = text
        else:
            assert last_frame is not None and encode_stream_frame(last_frame) == text


def test_readme_tour_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    text = (DOC.parents[1] / "README.md").read_text()
    tour = text[text.index("## A short tour") :]
    code = re.search(r"```python\n(.*?)```", tour, re.S)
    assert code is not None
    exec(compile(code.group(1), "README.md (tour)", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("CardInfo(") and printed[-1] == "(7, 8, 5, 6, 7, 8)"
