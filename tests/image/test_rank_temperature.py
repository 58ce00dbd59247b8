"""The rank temperature an image carries (``draft.rank_temperature``): packed, shown by
inspect, 0.5 when absent, and refused when out of range or not a float."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from exstill_sdk import CheckpointError, ImageError
from exstill_sdk.image import open_image, parse_image
from exstill_sdk.image.format import MetaType
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.image.reader import DEFAULT_RANK_TEMPERATURE

from .hostile import with_metadata


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "exstill_sdk.cli.pack", *args]
    return subprocess.run(command, capture_output=True, text=True)


def test_pack_cli_packs_it_and_inspect_shows_it(llama_dir: Path, tmp_path: Path) -> None:
    image = tmp_path / "warm.img"
    packed = cli(str(llama_dir), "-o", str(image), "--target", "t", "--rank-temperature", "1.26")
    assert packed.returncode == 0, packed.stderr
    with open_image(image, verify=True) as opened:
        assert opened.rank_temperature == 1.26
    assert json.loads(cli("inspect", str(image), "--json").stdout)["rank_temperature"] == 1.26
    assert "draft's softmax at temperature 1.26" in cli("inspect", str(image)).stdout
    plain = tmp_path / "plain.img"
    assert cli(str(llama_dir), "-o", str(plain), "--target", "t").returncode == 0
    with open_image(plain) as opened:
        assert opened.rank_temperature == DEFAULT_RANK_TEMPERATURE == 0.5
        assert "draft.rank_temperature" not in opened.metadata  # older images read the same
    bad = cli(str(llama_dir), "-o", str(tmp_path / "x.img"), "--target", "t",
              "--rank-temperature", "0")  # fmt: skip
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1
    assert "rank temperature must be from 0.05 to 20" in bad.stderr
    assert not (tmp_path / "x.img").exists()


def test_out_of_range_or_untyped_temperatures_are_refused(llama_dir: Path, tmp_path: Path):
    for value in (0.0, -1.0, 25.0, math.nan, math.inf):
        with pytest.raises(CheckpointError, match="rank temperature"):
            pack_checkpoint(llama_dir, tmp_path / "bad.img", "tiny", rank_temperature=value)
    pack_checkpoint(llama_dir, tmp_path / "ok.img", "tiny", rank_temperature=2.0)
    good = (tmp_path / "ok.img").read_bytes()
    assert parse_image(good).rank_temperature == 2.0

    def set_to(kind: int, value: object):
        return lambda meta: meta.__setitem__("draft.rank_temperature", (kind, value))

    for edit in (
        set_to(MetaType.F64, 0.01),
        set_to(MetaType.F64, 100.0),
        set_to(MetaType.F64, math.nan),
        set_to(MetaType.U64, 1),
        set_to(MetaType.STR, "warm"),
    ):
        with pytest.raises(ImageError, match=r"must be a float from 0\.05 to 20"):
            parse_image(with_metadata(good, edit))
