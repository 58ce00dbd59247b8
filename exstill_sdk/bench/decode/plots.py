"""PNG plots of an ``exstill-bench e2e`` result (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_e2e(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write the e2e figures as PNGs into ``directory``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    onnx = result["onnx_target"]
    written = []

    fixed = onnx["fixed_k"]
    ks = [int(k) for k in fixed]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [fixed[str(k)]["mean_acceptance_length"] for k in ks], "o-", label="mean")
    ax.plot(ks, [k + 1 for k in ks], ":", color="grey", label="K + 1 (every draft accepted)")
    ax.set(xlabel="K (tokens drafted per round)", ylabel="tokens per round", title="Acceptance")
    ax.legend()
    written.append(_save(fig, out / "e2e_acceptance_by_k.png"))

    labels = ["target alone", "card draft, adaptive", "lookup, adaptive"]
    values = [
        onnx["plain_tokens_per_s"],
        onnx["draft_adaptive"]["tokens_per_s"],
        onnx["lookup_adaptive"]["tokens_per_s"],
    ]
    labels += [f"card draft, K={k}" for k in ks]
    values += [fixed[str(k)]["tokens_per_s"] for k in ks]
    if "hf_target" in result:
        hf = result["hf_target"]
        labels += ["HF generate", "HF assisted", "HF target + card"]
        values += [hf[n]["tokens_per_s"] for n in ("plain", "hf_assisted", "exstill")]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(labels) + 1))
    ax.barh(labels[::-1], values[::-1])
    ax.set(xlabel="tokens/s", title="Greedy decoding, identical output")
    written.append(_save(fig, out / "e2e_tokens_per_s.png"))

    if "users" in result:
        rows = result["users"]["rows"]
        n = [r["users"] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(n, [r["adaptive"]["speedup"] for r in rows], "o-", label="card, adaptive K")
        best = [r["fixed_k"][str(r["best_fixed_k"])]["speedup"] for r in rows]
        ax.plot(n, best, "s--", label="card, best fixed K")
        ax.plot(n, [r["limit"] for r in rows], "^:", label="pair's limit (free draft)")
        ax.axhline(1.0, color="grey", linewidth=0.8, label="plain batching")
        ax.set_xticks(n)
        ax.set(
            xlabel="users (sequences verified in one pass)",
            ylabel="speed-up over plain batched decoding",
            title="Speed-up as users are added (memory-bound target)",
        )
        ax.legend()
        written.append(_save(fig, out / "e2e_users.png"))

    if "sizes" in result:
        rows = result["sizes"]["rows"]
        params = [r["parameters"] / 1e6 for r in rows]
        speedup = [r["speedup"]["median"] for r in rows]
        low = [r["speedup"]["median"] - r["speedup"]["min"] for r in rows]
        high = [r["speedup"]["max"] - r["speedup"]["median"] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.errorbar(params, speedup, yerr=[low, high], fmt="o-", capsize=3, label="measured")
        ax.plot(params, [r["limit"] for r in rows], "s:", label="pair's limit (free draft)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set(
            xlabel="target parameters (millions, f32)",
            ylabel="speed-up over the target alone",
            title="Same draft, same text, growing target",
        )
        ax.legend()
        written.append(_save(fig, out / "e2e_speedup_by_size.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
