"""exstill-pack from the command line: pack, inspect, verify, keygen, and clear failures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exstill_sdk.cli.pack import main

from ..cli.helpers import script


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script("exstill-pack"), *args], capture_output=True, text=True, timeout=120
    )


def test_pack_inspect_verify_keygen(llama_dir: Path, tmp_path: Path) -> None:
    out = run("keygen", "--dir", str(tmp_path / "keys"), "--name", "ci", "--json")
    assert out.returncode == 0, out.stderr
    key = json.loads(out.stdout)
    image = tmp_path / "tiny.img"
    out = run(
        str(llama_dir),
        "-o",
        str(image),
        "--target",
        "tiny-llama",
        "--dtype",
        "f16",
        "--sign-key",
        key["private_key"],
        "--json",
    )
    assert out.returncode == 0, out.stderr
    packed = json.loads(out.stdout)
    assert packed["signed"] and packed["key_id"] == key["key_id"] and packed["dtype"] == "f16"

    out = run("inspect", str(image), "--json")
    info = json.loads(out.stdout)
    assert info["target"] == "tiny-llama" and info["arch"]["num_layers"] == 2
    assert info["content_sha256"] == packed["content_sha256"]
    assert info["file_sha256"] == packed["file_sha256"] and info["tokenizer"]["vocab_size"] == 96
    human = run("inspect", str(image)).stdout
    assert "tiny-llama" in human and "exstill-decoder-v1" in human

    out = run("verify", str(image), "--trusted-keys", str(tmp_path / "keys"), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["signature_checked"] is True
    run("keygen", "--dir", str(tmp_path / "other"), "--name", "x")
    out = run("verify", str(image), "--trusted-keys", str(tmp_path / "other"))
    assert out.returncode == 1 and "not among" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_unsupported_checkpoint_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    out = run(str(tmp_path / "ckpt"), "-o", str(tmp_path / "x.img"), "--target", "x")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "exstill-pack: model_type 'gpt2' is not supported; exstill-pack reads llama, "
        "mistral, qwen2, qwen3 checkpoints"
    )
    out = run("inspect", str(tmp_path / "missing.img"))
    assert out.returncode == 2 and "no such file" in out.stderr and "Traceback" not in out.stderr


@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_inspect_on_mutated_images_fails_cleanly(
    small_image: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str], data
) -> None:
    image = bytearray(small_image)
    start = data.draw(st.integers(0, 20000))
    image[start : start + 4] = data.draw(st.binary(min_size=4, max_size=4))
    path = tmp_path / "m.img"
    path.write_bytes(bytes(image[: data.draw(st.integers(len(image) // 2, len(image)))]))
    code = main(["inspect", str(path)])
    captured = capsys.readouterr()
    if path.read_bytes() == small_image:
        assert code == 0
        return
    assert code == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("exstill-pack inspect: ")


def test_files_that_are_not_what_they_should_be_are_named_in_one_line(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A config.json or a tokenizer that is not JSON, a signing key that is not there or not a
    key: one line naming the file, no traceback; a file that is not there is exit 2."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("not json")
    out = run(str(broken), "-o", str(tmp_path / "a.img"), "--target", "x")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"exstill-pack: {broken / 'config.json'} is not JSON (line 1, column 1): it must be the "
        "model's HF config"
    )
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{oops")
    out = run(
        str(llama_dir),
        "-o",
        str(tmp_path / "b.img"),
        "--target",
        "x",
        "--tokenizer",
        str(tokenizer),
    )
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert (
        f"{tokenizer} is not JSON (line 1, column 2): it must be an HF tokenizer.json" in out.stderr
    )
    image = tmp_path / "c.img"
    assert run(str(llama_dir), "-o", str(image), "--target", "x").returncode == 0
    out = run("sign", str(image), "--key", str(tmp_path / "missing.pem"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot read the signing key" in out.stderr and "exstill-pack keygen" in out.stderr
    junk = tmp_path / "junk.pem"
    junk.write_text("junk")
    out = run("sign", str(image), "--key", str(junk))
    assert out.returncode == 1 and f"{junk} is not a PEM signing key" in out.stderr
