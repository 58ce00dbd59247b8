"""A frequency-ranked head (FR-Spec): packed from tied and untied checkpoints, read back,
refused when its ids lie, and run by the card's graph and as a transformers model with the
whole vocabulary's logits, minus infinity outside the head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from exstill_sdk import CheckpointError, ImageError, InvalidArgumentError
from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.execution.runner import OnnxDecoder
from exstill_sdk.image import open_image, parse_image
from exstill_sdk.image.format import MetaType
from exstill_sdk.image.pack import pack_checkpoint, read_head_ids
from exstill_sdk.image.quantize import dequantize_rows

from .checkpoints import VOCAB
from .hostile import with_metadata

HEAD = [5, 1, 40, 3, 17, 90, 60, 2, 33, 71, 8, 0]
"""Target ids of the head's rows, most frequent first (not sorted: the order is the image's)."""


def _source_rows(directory: Path, tied: bool) -> np.ndarray:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]


@pytest.mark.parametrize("fixture,tied", [("llama_dir", False), ("qwen3_dir", True)])
@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_the_head_keeps_its_rows(request, tmp_path: Path, fixture: str, tied: bool, dtype: str):
    directory = request.getfixturevalue(fixture)
    result = pack_checkpoint(directory, tmp_path / "h.img", "tiny", dtype, head_ids=HEAD)
    rows = _source_rows(directory, tied)
    with open_image(result.image.path, verify=True) as image:
        assert image.arch.head_size == len(HEAD) and image.arch.tie_embeddings is tied
        assert image.head_ids.tolist() == HEAD
        head = image.tensor("lm_head.weight")
        assert head.shape == (len(HEAD), rows.shape[1])
        if dtype == "f32":
            assert np.array_equal(head, rows[HEAD])
        else:
            scale = image.tensor("lm_head.weight.scale")
            err = np.abs(dequantize_rows(head, scale) - rows[HEAD])
            assert np.all(err <= scale[:, None] * 0.51)
        if tied:  # the input embedding stays whole
            assert image.tensor("embed.weight").shape == (VOCAB, rows.shape[1])
    whole = pack_checkpoint(directory, tmp_path / "w.img", "tiny", dtype)
    assert result.parameters == whole.parameters - (0 if tied else VOCAB * rows.shape[1]) + (
        len(HEAD) * rows.shape[1]
    )


def test_the_graph_spreads_the_head_over_the_vocabulary(llama_dir: Path, tmp_path: Path) -> None:
    pack_checkpoint(llama_dir, tmp_path / "whole.img", "tiny")
    pack_checkpoint(llama_dir, tmp_path / "head.img", "tiny", head_ids=HEAD)
    tokens = np.array([7, 3, 11, 50, 2, 9], np.int64)
    logits = []
    for name in ("whole", "head"):
        decoder = OnnxDecoder(open_image(tmp_path / f"{name}.img"), rows=1, positions=32)
        logits.append(decoder.prefill(0, tokens, 0, last=len(tokens)))
    whole, head = logits
    outside = np.setdiff1d(np.arange(VOCAB), HEAD)
    np.testing.assert_allclose(head[:, HEAD], whole[:, HEAD], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(head[:, outside]))
    # greedy from the head is the head's best token
    assert np.array_equal(head.argmax(-1), np.array(HEAD)[whole[:, HEAD].argmax(-1)])


def test_the_hf_model_of_a_head_image_matches_the_graph(qwen3_dir: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from exstill_sdk.image.hf import to_hf_model

    pack_checkpoint(qwen3_dir, tmp_path / "head.img", "tiny", head_ids=HEAD)
    image = open_image(tmp_path / "head.img")
    tokens = np.array([7, 3, 11, 50, 2, 9], np.int64)
    graph = OnnxDecoder(image, rows=1, positions=32).prefill(0, tokens, 0, last=len(tokens))
    with torch.no_grad():
        hf = to_hf_model(image)(torch.from_numpy(tokens)[None]).logits[0].numpy()
    assert np.array_equal(np.isneginf(hf), np.isneginf(graph))
    np.testing.assert_allclose(hf[:, HEAD], graph[:, HEAD], rtol=1e-4, atol=1e-4)


def test_bad_head_ids_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    for ids, match in (([], "1..96"), ([3, 3], "distinct"), ([1, VOCAB], "distinct")):
        with pytest.raises(CheckpointError, match=match):
            pack_checkpoint(llama_dir, tmp_path / "bad.img", "tiny", head_ids=ids)
    assert not (tmp_path / "bad.img").exists()
    pack_checkpoint(llama_dir, tmp_path / "head.img", "tiny", head_ids=HEAD)
    good = (tmp_path / "head.img").read_bytes()
    parse_image(good)

    def ids(value: list[int]):
        return lambda meta: meta.__setitem__("head.ids", (MetaType.U64_ARRAY, value))

    for edit, match in (
        (ids(HEAD[:-1]), "must list arch.head_size"),
        (ids([*HEAD[:-1], HEAD[0]]), "distinct ids"),
        (ids([*HEAD[:-1], VOCAB]), "distinct ids"),
        (lambda meta: meta.pop("head.ids"), "must list arch.head_size"),
        (lambda meta: meta.pop("arch.head_size"), "arch.head_size is 0"),
    ):
        with pytest.raises(ImageError, match=match):
            parse_image(with_metadata(good, edit))
    # a draft's head is no target: the target must score every token
    with pytest.raises(InvalidArgumentError, match="frequency-ranked head"):
        OnnxTarget(tmp_path / "head.img")


def test_pack_cli_reads_head_ids_and_inspect_shows_them(llama_dir: Path, tmp_path: Path) -> None:
    as_lines = tmp_path / "ids.txt"
    as_lines.write_text("\n".join(map(str, HEAD)) + "\n")
    as_json = tmp_path / "ids.json"
    as_json.write_text(json.dumps(HEAD))
    assert read_head_ids(as_lines) == read_head_ids(as_json) == HEAD
    (tmp_path / "bad.txt").write_text("5 six 7")
    with pytest.raises(CheckpointError, match="must hold token ids"):
        read_head_ids(tmp_path / "bad.txt")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "exstill_sdk.cli.pack", *args]
        return subprocess.run(command, capture_output=True, text=True)

    image = tmp_path / "head.img"
    packed = cli(str(llama_dir), "-o", str(image), "--target", "t", "--head-ids", str(as_lines))
    assert packed.returncode == 0, packed.stderr
    shown = cli("inspect", str(image))
    assert "output head 12 tokens" in shown.stdout
    assert json.loads(cli("inspect", str(image), "--json").stdout)["arch"]["head_size"] == 12
    missing = cli(str(llama_dir), "-o", str(tmp_path / "x"), "--target", "t", "--head-ids", "no")
    assert missing.returncode != 0 and "cannot read head ids from no" in missing.stderr


@pytest.mark.parametrize("dtype", ["f16", "int8"])
def test_a_head_cut_from_an_image_equals_one_packed(qwen3_dir: Path, tmp_path: Path, dtype: str):
    from exstill_sdk.image.head import cut_head

    pack_checkpoint(qwen3_dir, tmp_path / "whole.img", "tiny", dtype)
    packed = pack_checkpoint(qwen3_dir, tmp_path / "p.img", "tiny", dtype, head_ids=HEAD)
    with open_image(tmp_path / "whole.img") as whole:
        cut = cut_head(whole, HEAD, tmp_path / "c.img")
        with pytest.raises(CheckpointError, match="distinct"):
            cut_head(whole, [1, 1], tmp_path / "bad.img")
    with open_image(cut.path, verify=True) as a, open_image(packed.image.path) as b:
        assert a.metadata == b.metadata and set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            assert np.array_equal(a.tensor(name), b.tensor(name)), name
        with pytest.raises(ImageError, match="has a head already"):
            cut_head(a, HEAD, tmp_path / "again.img")
