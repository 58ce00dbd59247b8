"""exstill-bench prints the figures it promises (values are not timed here)."""

from __future__ import annotations

import json
import subprocess

from exstill_sdk.bench.decode.shapes import paired_ratio
from exstill_sdk.bench.decode.shapes import table as shapes_table
from exstill_sdk.speculative.decoder import DEFAULT_TREES

from .helpers import script, start_emu


def _bench(*args: str) -> dict:
    out = subprocess.run(
        [script("exstill-bench"), "roundtrip", "--rounds", "300", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_emu_roundtrip_json() -> None:
    result = _bench("--url", "emu://", "--k", "6")
    assert {"url", "k", "rounds", "p50_us", "p99_us", "bytes_per_round"} <= result.keys()
    assert result["k"] == 6 and result["rounds"] == 300
    assert result["p50_us"] > 0
    # 22-byte COMMIT frame + 42-byte reply carrying six tokens; whole frames in process.
    assert result["bytes_per_round"] == 64


def test_tcp_roundtrip_json_has_raw_socket_baseline() -> None:
    proc, url = start_emu()
    try:
        result = _bench("--url", url, "--placement", "none", "--streams", "4")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert result["bytes_per_round"] == 68  # COBS adds 2 bytes per frame
    assert result["raw_socket_p50_us"] > 0 and result["ratio_to_raw_p50"] > 0
    assert result["placement"] == "none"
    assert result["streams"] == 4
    assert result["step_sequential_p50_us"] > 0 and result["step_pipelined_p50_us"] > 0


def test_bad_arguments_exit_2() -> None:
    out = subprocess.run(
        [script("exstill-bench"), "roundtrip", "--url", "bogus://", "--json"],
        capture_output=True,
        text=True,
    )
    error = json.loads(out.stdout)  # with --json the error is one JSON object on stdout
    assert out.returncode == 2 and error["exit"] == 2 and "scheme" in error["error"]
    out = subprocess.run(
        [script("exstill-bench"), "roundtrip", "--url", "bogus://"], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "scheme" in out.stderr


def test_engine_bench_json() -> None:
    out = subprocess.run(
        [
            script("exstill-bench"),
            "engine",
            "--synthetic",
            "1x64",
            "--rounds",
            "6",
            "--k",
            "4",
            "--no-hf",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["layers"] == 1 and result["hidden"] == 64 and result["k"] == 4
    assert result["us_per_token_1_stream"] > 0 and result["us_per_token_12_streams"] > 0


def test_e2e_bench_json_every_run_is_exact(tmp_path, demo_cache) -> None:
    out = subprocess.run(
        [
            *(script("exstill-bench"), "e2e", "--prompts", "2", "--new-tokens", "12"),
            *("--max-k", "3", "--users", "1,3", "--users-k", "1,2", "--users-repeats", "1"),
            *("--json", "--plot", str(tmp_path)),
            *("--sizes", "small,384", "--size-runs", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    onnx, hf = result["onnx_target"], result["hf_target"]
    runs = [onnx["draft_adaptive"], onnx["lookup_adaptive"], *onnx["fixed_k"].values()]
    assert all(r["exact"] for r in runs) and len(onnx["fixed_k"]) == 3
    # The card's own prefetch counters over each run agree with the hits the host was told of.
    for r in runs:
        assert r["card_prefetch"]["hits"] == r["prefetch_hits"] <= r["card_prefetch"]["rounds"]
    users = result["users"]  # the users curve, on the large demo target
    assert users["exact"] and [r["users"] for r in users["rows"]] == [1, 3]
    for row in users["rows"]:
        assert row["exact"] and set(row["fixed_k"]) == {"1", "2"} and row["best_fixed_k"] in (1, 2)
        assert row["plain_tokens_per_s"] > 0 and row["adaptive"]["tokens_per_s"] > 0
        assert row["speedup"] == row["adaptive"]["speedup"] > 0 and row["limit"] > 0
        assert row["waves"] == 1 and row["streams_used"] == row["users"]
        # the card's counters over each way's run: every round a hit, a miss or late
        for way in (row["adaptive"], *row["fixed_k"].values()):
            ahead = way["card_prefetch"]
            assert ahead["hits"] + ahead["misses"] + ahead["late"] == ahead["rounds"]
            assert ahead["hits"] == way["prefetch_hits"]
        assert row["fixed_k"]["2"]["card_prefetch"]["rounds"] > 0
    assert all(hf[name]["exact"] for name in ("plain", "hf_assisted", "exstill"))
    # acceptance grows with K (fixed K, one draft model): more tokens per round
    lengths = [onnx["fixed_k"][k]["mean_acceptance_length"] for k in ("1", "2", "3")]
    assert lengths[0] <= 2.0 and lengths[-1] >= lengths[0]
    assert onnx["best_fixed_k"] in (1, 2, 3)
    rows = result["sizes"]["rows"]
    assert [r["size"] for r in rows] == ["small", "384"] and all(r["identical"] for r in rows)
    assert rows[0]["parameters"] < 5e6 < rows[1]["parameters"]
    for row in rows:
        assert row["verify_cost_steps"]["1"] == 1.0 and row["limit"] >= 1.0
        assert row["oracle_limit"] >= row["limit"] - 0.01
        taus = list(row["tokens_a_pass_at_k"].values())
        assert len(taus) == 3 and taus == sorted(taus) and taus[0] >= 1.0
        ahead = row["card_prefetch"]  # its warm-up run too, which the host's count leaves out
        assert ahead["rounds"] > 0 and ahead["hits"] >= row["prefetch_hits"]
        assert abs(row["efficiency"] - row["speedup"]["median"] / row["limit"]) < 0.01
    assert (demo_cache / "exstill").is_dir()  # built into the cache, not into the package
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "e2e_acceptance_by_k.png",
        "e2e_speedup_by_size.png",
        "e2e_tokens_per_s.png",
        "e2e_users.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.iterdir())


def test_host_cost_bench_json() -> None:
    out = subprocess.run(
        [
            script("exstill-bench"),
            "host",
            "--contexts",
            "100,2000",
            "--rounds",
            "60",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for way in ("host", "host_beside_target"):
        per_round = result[f"{way}_us_per_round"]
        # the figures' sizes are for the benchmark to show, not for a test to time
        assert set(per_round) == {"100", "2000"}
        assert all(isinstance(v, float) for v in per_round.values())
        assert isinstance(result[f"{way}_ratio_2000_to_100"], float)


def test_profile_bench_feeds_the_planner(tmp_path) -> None:
    """exstill-bench profile measures this machine's profiles; exstill plan reads them."""
    args = ("profile", "--target", "small", "--users", "1,2", "--out", str(tmp_path), "--json")
    out = subprocess.run(
        [script("exstill-bench"), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    passes = result["target"]["target"]["pass"]
    assert sorted(set(passes["batch"])) == [1, 2] and len(passes["tokens"]) == 2 * 9
    assert result["target"]["target"]["tree_pass"] > 0  # a tree's pass over a chain's
    card = result["card"]["card"]
    assert card["draft_us_per_token"] > 0 and card["link_rtt_us"] > 0
    assert card["overflow"] == "target-alone" and result["card"]["host"]["us_per_round"] >= 0
    # a pass beside the drafting card against the table's (card idle), per user count where
    # the long pilot run's passes took longer than the short one's (on a loaded machine a
    # count can go without)
    assert result["target_slowdown_by_users"]
    assert set(result["target_slowdown_by_users"]) <= {"1", "2"}
    assert card["target_slowdown"] >= 1.0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["card.json", "run-1-users.json", "run-2-users.json", "target.json"]
    for users in ("1", "2"):  # the draft's top-k along each pilot run's text
        top_k = result["runs"][users]["top_k"]
        assert len(top_k) == 8 and top_k == sorted(top_k) and 0.0 < top_k[0] <= top_k[-1] <= 1
    files = {
        name: str(tmp_path / f"{stem}.json")
        for name, stem in (("target", "target"), ("card", "card"), ("acceptance", "run-2-users"))
    }
    plan = subprocess.run(
        [script("exstill"), "plan", *(f"--{k}={v}" for k, v in files.items()), "--users=1,2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert "largest" not in plan.stdout and len(plan.stdout.splitlines()) == 2 + 2  # a table
    plan = subprocess.run(
        [script("exstill"), "plan", *(f"--{k}={v}" for k, v in files.items()), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = json.loads(plan.stdout)["rows"]
    assert [r["users"] for r in rows] == [1, 2, 4, 8, 16] and all(
        r["tokens_per_s"] > 0 for r in rows
    )


def test_plan_check_rows_are_predicted_against_measured() -> None:
    """The check's machinery end to end on a small configuration (how close it comes is a
    benchmark figure, docs/planning.md, not asserted here)."""
    from exstill_sdk.plan.measure import check as plan_check

    result = plan_check.run(
        targets=("small",), users=(1, 2), new_tokens=40, repeats=1, min_run_s=0.3
    )
    rows = result["rows"]
    assert [(r["target"], r["users"]) for r in rows] == [("small", 1)] * 2 + [("small", 2)]
    tree, *chains = rows
    for r in rows:
        assert r["predicted_tokens_per_s"] > 0 and r["measured_tokens_per_s"] > 0
        assert r["pass_drift"] > -1.0  # the passes timed between the runs against before them
        ratio = r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] - 1
        assert abs(r["error"] - ratio) < 1e-3
        # the run's own passes against the table's: the slowdown the prediction takes, and the
        # prediction with the profile's in its place
        assert r["pass_slowdown"] > 0 and r["measured_verify_ms"] > 0
        assert r["profile_pass_slowdown"] >= 1.0 and r["profile_slowdown_tokens_per_s"] > 0
    # the tree row: a tree of 8 every round, drafted on the spot (the runtime never drafts a
    # tree ahead), its levels at the card's measured cost
    assert tree["shape"] == plan_check.TREE_NAME and tree["k"] == plan_check.TREE.nodes
    assert tree["predicted_prefetch_hit_rate"] == tree["measured_prefetch_hit_rate"] == 0.0
    assert 1.0 < tree["measured_mean_acceptance_length"] <= plan_check.TREE.depth + 1
    # every tree round is drafted when its COMMIT comes: the card's part is the model's too
    assert tree["measured_round_trip_ms"] > 0 and tree["predicted_round_trip_ms"] > 0
    card = result["profiles"]["small"]["card"]["card"]
    assert card["tree_level_us"] > 0 and card["prefetch_trees"] is False
    assert card["outcome_pass_us"] > 0 and card["outcome_us"] >= 0  # its outcome trees' passes
    for r in chains:
        assert r["shape"] == f"chain of {r['k']}" and 0 <= r["k"] <= 8
        # hits on drafts made ahead for other outcomes than full acceptance are hits
        assert 0.0 <= r["measured_outcome_hit_rate"] <= r["measured_prefetch_hit_rate"]
        assert r["predicted_outcomes_ahead"] <= (16 if r["k"] else 0)
        # acceptance over the decode window and over the whole run, both real lengths
        for key in ("measured_mean_acceptance_length", "whole_run_mean_acceptance_length"):
            assert 1.0 <= r[key] <= r["k"] + 1
        assert (r["measured_round_trip_ms"] > 0) == (r["predicted_round_trip_ms"] > 0)
    assert result["max_abs_error"] == max(abs(r["error"]) for r in rows)
    assert result["ok"] == (result["max_abs_error"] <= plan_check.TOLERANCE)


def test_profile_bench_hf_target() -> None:
    """The same profiles with the demo target on transformers: a pass timed for every user
    count and every K (its tokens: users x (K + 1)); nothing here rests on the times."""
    args = ("profile", "--target", "small", "--adapter", "hf", "--users", "1,2", "--json")
    out = subprocess.run(
        [script("exstill-bench"), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    target = json.loads(out.stdout)["target"]["target"]
    assert target["name"] == "demo-small-hf"
    passes = target["pass"]
    ms = dict(zip(zip(passes["batch"], passes["tokens"], strict=True), passes["ms"], strict=True))
    assert set(ms) == {(users, users * (k + 1)) for users in (1, 2) for k in range(9)}
    assert all(v > 0 for v in ms.values())


def test_trees_bench_sets_trees_beside_the_chain() -> None:
    def trees(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script("exstill-bench"), "trees", "--files", "1", "--rounds", "3", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )

    out = trees("--budgets", "2,6", "--target", "small", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    timed = result["target"]
    assert timed["name"] == "small" and set(timed["verify_us"]) == {"1", "2", "6"}
    limits = {f"chain of {row['drafted']}": row["chain_limit"] for row in result["rows"]} | {
        f"tree of {row['drafted']}": row["best_tree_limit"] for row in result["rows"]
    }
    assert timed["chosen_limit"] == max(limits.values())
    assert timed["chosen"].split(" (")[0] in limits
    assert result["files"] == 1 and result["rounds_per_file"] == 3
    # the demo draft's calibration on the same text: its image ranks at the default 0.5
    cal = result["rank_temperature"]
    assert cal["image"] == 0.5 and cal["positions"] > 0 and 0.1 <= cal["fit"] <= 10.0
    assert [row["budget"] for row in result["rows"]] == [2, 6]
    one = result["rows"][0]
    for row in result["rows"]:
        kept = [row["chain_tokens_per_pass"]] + [t["tokens_per_pass"] for t in row["trees"]]
        assert all(1 <= k <= row["budget"] for k in kept)  # a pass keeps 1..N tokens
        assert row["best_tree"] == max(row["trees"], key=lambda t: t["tokens_per_pass"])
    # one drafted token: every tree is the draft's top-1, the chain itself
    assert all(t["tokens_per_pass"] == one["chain_tokens_per_pass"] for t in one["trees"])
    text = trees("--budgets", "2,6", "--target", "none")
    assert text.returncode == 0 and text.stdout.splitlines()[1].split()[:2] == ["budget", "chain"]
    refused = trees("--budgets", "1")
    assert refused.returncode == 2 and "--budgets wants 2 or more" in refused.stderr


def test_shapes_bench_runs_every_way_exactly() -> None:
    """One user on the small demo target, two held-out prompts and the demo's: every way's
    speed-up, auto's shapes, exact output (the figures themselves are not judged here)."""
    out = subprocess.run(
        [
            script("exstill-bench"),
            "shapes",
            "--target",
            "small",
            "--prompts",
            "2",
            "--new-tokens",
            "40",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["exact"] is True and result["prompts"] == 3  # two held out, the demo's
    ways = [row["way"] for row in result["rows"]]
    assert ways[:4] == ["chain, adaptive K", "chain, K=4", "chain, K=8", "chain, K=16"]
    assert "auto (adaptive K, trees where they pay)" in ways
    assert any(way.startswith("tree of 8 (top-2, depth 6)") for way in ways)
    assert result["best_chain"].startswith("chain")
    for row in result["rows"]:
        assert len(row["speedup_by_prompt"]) == 3 and row["speedup_median"] > 0
        by_prompt = row["speedup_by_prompt"]
        assert min(by_prompt) - 0.001 <= row["speedup_geomean"] <= max(by_prompt) + 0.001
        assert 1 <= row["mean_acceptance_length"] <= 17
    assert result["best_chain_geomean"].startswith("chain")
    assert result["auto_over_best_chain_geomean"] > 0
    assert ways[-1] == "chain, adaptive K (again: the run's noise)"
    assert result["best_chain"] != ways[-1] and result["noise"]["again_over_adaptive"] > 0
    assert result["paired"]["auto_over_best_chain"] > 0
    assert result["paired"]["again_over_adaptive"] > 0
    assert "paired (each repeat's decoding rates side by side" in shapes_table(result)
    # auto's rounds, by shape: the chain or one of the decoder's candidate trees
    names = {"chain"} | {
        f"tree of {t.nodes} (top-{t.top_k}, depth {t.depth})" for t in DEFAULT_TREES
    }
    for chosen in result["auto_shapes_chosen"].values():
        assert set(chosen) <= names and all(n > 0 for n in chosen.values())
    refused = subprocess.run(
        [script("exstill-bench"), "shapes", "--repeats", "0"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--repeats" in refused.stderr


def test_shapes_users_curve_runs_trees_in_batches_exactly() -> None:
    """The users curve with shapes on the small demo target: auto and each fixed tree beside
    the adaptive chain at each user count, every output the target's own."""
    args = ["shapes", "--target", "small", "--users", "1,2", "--new-tokens", "24"]
    out = subprocess.run(
        [script("exstill-bench"), *args, "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["exact"] is True and [row["users"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert len(row["tokens_per_s"]) == 2 + len(DEFAULT_TREES)
        assert all(v > 0 for v in row["tokens_per_s"].values())
        assert set(row["over_chain"]) == set(row["tokens_per_s"]) - {"chain, adaptive K"}
    refused = subprocess.run(
        [script("exstill-bench"), "shapes", "--users", "0,2"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--users" in refused.stderr


def test_prefetch_bench_counts_both_ways_exactly() -> None:
    """Full-acceptance prefetch against prefetch for several outcomes on the small demo
    target: the card's own counters per way, every round's reply timed, exact output (the
    figures themselves are not judged here)."""
    args = ["--target", "small", "--prompts", "1", "--new-tokens", "40", "--repeats", "1"]
    out = subprocess.run(
        [script("exstill-bench"), "prefetch", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [row["way"] for row in result["rows"]] == ["full acceptance only", "several outcomes"]
    for row in result["rows"]:
        assert row["identical"] is True
        (report,) = row["prefetch_by_run"]
        assert report["rounds"] == row["rounds"] > 0
        assert report["hits"] + report["misses"] + report["late"] == report["rounds"]
        assert sum(report["hits_by_accepted"].values()) == report["hits"]
        assert row["ping_after_verify_us"]["median"] > 0
    full = result["rows"][0]["prefetch_by_run"][0]
    assert full["outcome_hits"] == full["outcome_partial"] == 0  # that card drafts none
    bad = subprocess.run(
        [script("exstill-bench"), "prefetch", "--target", "tiny"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--target: 'tiny' is not small, large" in bad.stderr


def test_policy_bench_replays_its_own_records(tmp_path) -> None:
    """On the small demo target, one held-out prompt and the demo's: each prompt's acceptance
    record as the card gave it, every fixed K and the adaptive policy replayed over it beside
    the real decoder's runs; ``--records`` replays that output again to the same figures (the
    replay is deterministic), and refuses a file that is not one."""
    args = ["policy", "--target", "small", "--prompts", "1", "--new-tokens", "48", "--json"]
    out = subprocess.run(
        [script("exstill-bench"), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    record, replayed = result["record"], result["replayed"]
    assert len(record["kept"]) == 2 and all(len(text) == 48 for text in record["kept"])
    assert set("".join(record["kept"])) <= {"0", "1"}
    assert len(record["costs"]["verify_ms"]) == 17 and record["costs"]["plain_ms"] > 0
    assert set(record["measured"]) == {"K=4", "K=8", "adaptive"}
    assert list(replayed["rows"]) == [*(f"K={k}" for k in range(1, 17)), "adaptive"]
    assert replayed["best_fixed"] in replayed["rows"]
    for name, by_prompt in replayed["rows"].items():
        assert len(by_prompt) == 2 and all(s > 0 for s in by_prompt), name
    saved = tmp_path / "policy.json"
    saved.write_text(out.stdout)
    again = subprocess.run(
        [script("exstill-bench"), "policy", "--records", str(saved), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["replayed"] == replayed
    (tmp_path / "bad.json").write_text("{}")
    refused = subprocess.run(
        [script("exstill-bench"), "policy", "--records", str(tmp_path / "bad.json")],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--records" in refused.stderr


def test_paired_ratio_is_the_geometric_mean_of_each_prompts_median() -> None:
    # prompt 0: repeats at 2x and 3x (median 2.5x); prompt 1: 1x
    assert paired_ratio([[2.0, 6.0], [1.0]], [[1.0, 2.0], [1.0]]) == round(2.5**0.5, 3)
