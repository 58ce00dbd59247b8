"""Pack tiny real checkpoints and read them back: tensors equal the checkpoint's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from exstill_sdk import CheckpointError
from exstill_sdk.image import open_image
from exstill_sdk.image.checkpoint import image_name
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.image.quantize import dequantize_rows

from .checkpoints import save_model


def _checkpoint_tensors(directory: Path, tied: bool) -> dict[str, np.ndarray]:
    out = {}
    for path in directory.glob("*.safetensors"):
        for hf_name, value in load_file(path).items():
            name = image_name(hf_name)
            if name and not (tied and name == "lm_head.weight"):
                out[name] = value
    return out


@pytest.mark.parametrize("fixture,tied", [("llama_dir", False), ("qwen3_dir", True)])
@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_round_trip(request, tmp_path: Path, fixture: str, tied: bool, dtype: str) -> None:
    directory = request.getfixturevalue(fixture)
    result = pack_checkpoint(directory, tmp_path / "x.img", "tiny", dtype)
    expected = _checkpoint_tensors(directory, tied)
    with open_image(result.image.path, verify=True) as image:
        assert image.arch.tie_embeddings is tied and image.quant == dtype
        assert ("lm_head.weight" in image.tensors) is not tied
        for name, want in expected.items():
            got = image.tensor(name)
            if want.ndim == 1 or dtype == "f32":
                assert got.dtype == np.float32 and np.array_equal(got, want), name
            elif dtype == "f16":
                assert got.dtype == np.float16 and np.array_equal(got, want.astype(np.float16))
            else:
                scale = image.tensor(name + ".scale")
                err = np.abs(dequantize_rows(got, scale) - want)
                # the documented bound: half a quantisation step, plus float32 rounding
                assert np.all(err <= scale[:, None] * (0.5 + 1e-5)), name
                assert got.min() >= -127
        assert result.parameters == sum(v.size for v in expected.values())


def test_qwen3_specifics(qwen3_dir: Path, tmp_path: Path) -> None:
    pack_checkpoint(qwen3_dir, tmp_path / "q.img", "tiny-qwen3")
    with open_image(tmp_path / "q.img") as image:
        arch = image.arch
        assert (arch.qk_norm, arch.head_dim, arch.num_kv_heads, arch.source) == (
            True,
            16,
            2,
            "qwen3",
        )
        assert image.tensor("layers.1.attn.q_norm.weight").shape == (16,)
        assert image.tensor("layers.0.attn.q.weight").shape == (64, 64)  # 4 heads x 16


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families(tmp_path: Path, family: str) -> None:
    directory = save_model(tmp_path / family, family)
    pack_checkpoint(directory, tmp_path / "x.img", family)
    expected = _checkpoint_tensors(directory, False)
    with open_image(tmp_path / "x.img", verify=True) as image:
        assert image.arch.qkv_bias is (family == "qwen2")
        for name, want in expected.items():
            assert np.array_equal(image.tensor(name), want), name


def test_bf16_and_sharded_checkpoint(tmp_path: Path) -> None:
    import torch
    import transformers as tf

    directory = save_model(tmp_path / "bf16", "llama", dtype="bfloat16")
    model = tf.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    (sharded / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    assert (sharded / "model.safetensors.index.json").exists()
    pack_checkpoint(sharded, tmp_path / "x.img", "bf16", "f32")
    with open_image(tmp_path / "x.img") as image:
        want = model.model.layers[1].mlp.down_proj.weight.detach().float().numpy()
        assert np.array_equal(image.tensor("layers.1.mlp.down.weight"), want)  # exact widening


def test_unsupported_checkpoints_name_what_is_supported(tmp_path: Path, llama_dir: Path) -> None:
    import json
    import shutil

    bad = tmp_path / "gpt2"
    shutil.copytree(llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="llama, mistral, qwen2, qwen3"):
        pack_checkpoint(bad, tmp_path / "x.img", "x")
    v4 = {k: v for k, v in config.items() if k != "rope_parameters"}
    (bad / "config.json").write_text(
        json.dumps({**v4, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    )
    with pytest.raises(CheckpointError, match="supported: default, linear, dynamic, yarn, llama3"):
        pack_checkpoint(bad, tmp_path / "x.img", "x")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="f32, f16, int8"):
        pack_checkpoint(bad, tmp_path / "x.img", "x", "int4")
    (bad / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="--tokenizer"):
        pack_checkpoint(bad, tmp_path / "x.img", "x")
    pack_checkpoint(bad, tmp_path / "x.img", "x", tokenizer=llama_dir / "tokenizer.json")
    assert not list(tmp_path.glob(".x.img.*"))  # failed packs leave no temporary files


def test_rope_scaling_is_carried(tmp_path: Path, llama_dir: Path) -> None:
    import json
    import shutil

    directory = tmp_path / "rope"
    shutil.copytree(llama_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (directory / "config.json").write_text(json.dumps(config))
    pack_checkpoint(directory, tmp_path / "x.img", "rope")
    with open_image(tmp_path / "x.img") as image:
        rope = image.arch.rope_scaling
        assert image.arch.rope_theta == 500000.0
        assert (rope.type, rope.factor, rope.original_max_position_embeddings) == (
            "llama3",
            8.0,
            8192,
        )
