"""exstill-pack reading GGUF files: the tests' tiny checkpoints written as llama.cpp writes
them, packed, and compared with the same checkpoint packed from safetensors, and with
transformers' own GGUF loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exstill_sdk import CheckpointError
from exstill_sdk.image import open_image
from exstill_sdk.image.pack import pack_checkpoint

from .gguf_files import save_gguf

pytest.importorskip("gguf")


def _packed(path: Path) -> dict[str, np.ndarray]:
    with open_image(path, verify=True) as image:
        return {name: np.array(image.tensor(name)) for name in image.tensors}


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen3_dir"])
def test_f32_gguf_packs_as_its_checkpoint(request, tmp_path: Path, fixture: str) -> None:
    directory = request.getfixturevalue(fixture)
    gguf_path = save_gguf(directory, tmp_path / "m.gguf")
    pack_checkpoint(directory, tmp_path / "hf.img", "tiny")
    result = pack_checkpoint(gguf_path, tmp_path / "gguf.img", "tiny")
    want, got = _packed(tmp_path / "hf.img"), _packed(result.image.path)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name  # llama's q/k rows put back exactly
    with open_image(tmp_path / "hf.img") as a, open_image(tmp_path / "gguf.img") as b:
        assert b.arch == a.arch  # eps and theta read back as the decimals written
        assert b.tokenizer.matches(a.tokenizer)


@pytest.mark.parametrize("kind,step", [("Q8_0", 1 / 127), ("Q4_1", 1 / 15)])
def test_quantised_gguf_is_dequantised(
    llama_dir: Path, tmp_path: Path, kind: str, step: float
) -> None:
    gguf_path = save_gguf(llama_dir, tmp_path / "q.gguf", kind)
    pack_checkpoint(llama_dir, tmp_path / "hf.img", "tiny")
    pack_checkpoint(gguf_path, tmp_path / "q.img", "tiny", "f16")
    want, got = _packed(tmp_path / "hf.img"), _packed(tmp_path / "q.img")
    for name, value in want.items():
        if value.ndim == 1:
            assert np.array_equal(got[name], value), name
            continue
        # each block of 32 keeps its range to within one quantisation step (and f16 rounding)
        blocks = value.reshape(value.shape[0], -1, 32)
        span = (blocks.max(-1) - blocks.min(-1))[..., None]
        err = np.abs(got[name].astype(np.float32).reshape(blocks.shape) - blocks)
        assert np.all(err <= span * step + 1e-3), name
        assert not np.array_equal(got[name], value.astype(np.float16)), name  # it was quantised


def test_padding_tokens_are_unused_ids(llama_dir: Path, tmp_path: Path) -> None:
    """The converter's [PAD<i>] fillers past the tokenizer's last token are not part of its
    identity: the image matches the tokenizer.json's fingerprint."""
    gguf_path = save_gguf(llama_dir, tmp_path / "p.gguf", pad_to=100)
    pack_checkpoint(llama_dir, tmp_path / "hf.img", "tiny")
    pack_checkpoint(gguf_path, tmp_path / "p.img", "tiny")
    with open_image(tmp_path / "hf.img") as a, open_image(tmp_path / "p.img") as b:
        assert b.tokenizer.matches(a.tokenizer) and b.tokenizer.vocab_size == 96


def test_transformers_reads_the_same_weights(llama_dir: Path, tmp_path: Path) -> None:
    """transformers' GGUF loader (its own reverse of the q/k permutation) gives the weights
    our image holds: the tests' writer and our reader follow llama.cpp, not each other."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from exstill_sdk.image.checkpoint import image_name

    gguf_path = save_gguf(llama_dir, tmp_path / "t.gguf")
    pack_checkpoint(gguf_path, tmp_path / "t.img", "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="t.gguf")
    got = _packed(tmp_path / "t.img")
    compared = 0
    for hf_name, value in model.state_dict().items():
        name = image_name(hf_name)
        if name in got:
            assert np.array_equal(got[name], value.numpy()), hf_name
            compared += 1
    assert compared == len(got)


def test_bad_gguf_files(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        pack_checkpoint(broken, tmp_path / "x.img", "tiny")
    good = save_gguf(llama_dir, tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match="carries its tokenizer"):
        pack_checkpoint(good, tmp_path / "x.img", "tiny", tokenizer=llama_dir / "tokenizer.json")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError):
        pack_checkpoint(truncated, tmp_path / "x.img", "tiny")
    assert not (tmp_path / "x.img").exists()


def test_cli_packs_a_gguf_file(llama_dir: Path, tmp_path: Path) -> None:
    gguf_path = save_gguf(llama_dir, tmp_path / "m.gguf", "Q8_0")
    command = [sys.executable, "-m", "exstill_sdk.cli.pack", str(gguf_path)]
    command += ["-o", str(tmp_path / "c.img"), "--target", "tiny", "--dtype", "int8", "--json"]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["dtype"] == "int8" and report["target"] == "tiny"
    with open_image(tmp_path / "c.img", verify=True) as image:
        assert image.arch.source == "llama" and image.quant == "int8"


@pytest.mark.skipif(
    not os.environ.get("EXSTILL_GGUF_MODEL"),
    reason="set EXSTILL_GGUF_MODEL to a real GGUF file (docs/image-format.md, section 10)",
)
def test_a_real_gguf_model(tmp_path: Path) -> None:
    """A real quantised model: every tensor equal to what transformers dequantises, and the
    tokenizer identity equal to that of transformers' tokenizer built from the same file."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exstill_sdk.image.checkpoint import image_name
    from exstill_sdk.image.tokenizer import fingerprint_hf_tokenizer

    source = Path(os.environ["EXSTILL_GGUF_MODEL"])
    pack_checkpoint(source, tmp_path / "real.img", "real")
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    with open_image(tmp_path / "real.img") as image:
        assert fingerprint_hf_tokenizer(tokenizer).matches(image.tokenizer)
        for hf_name, value in model.state_dict().items():
            name = image_name(hf_name)
            if name in image.tensors:
                assert np.array_equal(image.tensor(name), value.numpy()), hf_name


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_gguf_files_fail_cleanly(llama_dir: Path, tmp_path: Path, data) -> None:
    """Bytes of a real GGUF file, changed or cut: packing either succeeds or raises
    CheckpointError, and leaves no partial image."""
    source = tmp_path / "seed.gguf"
    if not source.exists():
        save_gguf(llama_dir, source, "Q8_0")
    raw = bytearray(source.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, min(len(raw) - 1, 4096)))  # header, metadata, tensor table
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(5, len(raw)))]
    mutated = tmp_path / "fuzz.gguf"
    mutated.write_bytes(bytes(raw))
    out = tmp_path / "fuzz.img"
    try:
        pack_checkpoint(mutated, out, "tiny")
    except CheckpointError:
        assert not out.exists()
    else:
        out.unlink()
