"""End-to-end speculative decoding with the demo pair on held-out prompts, side by side in one run:

- the ONNX target alone, with the card's transformer draft and with its prompt-lookup engine;
- acceptance and tokens/s for fixed K = 1..8, and adaptive K against the best fixed K;
- the users curve on the large (memory-bound) demo target (bench.decode.users): plain batching
  against the card, adaptive K against every fixed K, 1 to 16 users;
- the same two models loaded into transformers from the same weights: the target's own greedy
  ``generate``, HF assisted generation (``generate(assistant_model=draft)``), and our decoder
  with that HF target and the card;
- the same draft against the target at several sizes (bench.decode.sizes): the speed-up as the
  target's step turns from bound by arithmetic to bound by memory.

Every speculative output is compared with the target's own greedy output (``exact``). Prompts
are the first ``prompt_tokens`` tokens of held-out standard-library files (training.json).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from exstill_sdk.demo import (
    DRAFT_TARGET,
    POSITIONS,
    THREADS,
    demo_dir,
    emulator_args,
    held_out_prompts,
)
from exstill_sdk.harness.card_process import emulator_process, pinned, split_cores
from exstill_sdk.harness.speedup import verify_curve
from exstill_sdk.harness.timing import timed
from exstill_sdk.support.prefetch import prefetch_report

KList = tuple[int, ...]


def run(
    *,
    prompts: int = 3,
    prompt_tokens: int = 96,
    new_tokens: int = 128,
    ks: KList = (1, 2, 3, 4, 5, 6, 7, 8),
    users: KList = (1, 2, 4, 8, 12, 16),
    users_ks: KList = (1, 2, 3, 4, 6, 8),
    users_repeats: int = 2,
    hf: bool = True,
    sizes: tuple[str, ...] = (),
    size_runs: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.card import open_card
    from exstill_sdk.speculative import SpeculativeDecoder

    data = demo_dir()
    inputs = held_out_prompts(prompts, prompt_tokens)
    n_out = new_tokens * len(inputs)
    host_cpu, card_cpu = split_cores()
    with pinned(host_cpu):  # the target and the host's loop on one core, the card on another
        target = OnnxTarget(data / "target.img", positions=POSITIONS, threads=THREADS)
        plain_s = 0.0
        reference = []
        for p in inputs:
            s, out = timed(target.greedy, p, new_tokens)
            plain_s += s
            reference.append(out)
        result: dict[str, Any] = {
            "prompts": len(inputs),
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "onnx_target": {
                "plain_tokens_per_s": round(n_out / plain_s, 1),
                "verify_us": verify_curve(target, inputs[0], range(1, max(ks) + 2)),
            },
        }

        def speculate(card: Any, k: int | Literal["adaptive"], draft: str | None) -> dict[str, Any]:
            decoder = SpeculativeDecoder(card, target, draft=draft, k=k, max_k=max(ks))
            seconds, outs = 0.0, []
            before = card.stats()
            for p in inputs:
                s, r = timed(decoder.generate, p, new_tokens, stop_token_ids=[])
                seconds += s
                outs.append(r.tokens)
            card_prefetch = prefetch_report(card.stats(), before)
            m = decoder.metrics
            return {
                "tokens_per_s": round(n_out / seconds, 1),
                "speedup": round(plain_s / seconds, 2),
                "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                "prefetch_hits": m.prefetch_hits,
                "rounds": m.rounds,
                "k_chosen": {str(k): v for k, v in sorted(m.k_chosen.items())},
                "card_prefetch": card_prefetch,
                "exact": outs == reference,
            }

        with emulator_process(*emulator_args(), cpu=card_cpu) as url, open_card(url) as card:
            for draft in (DRAFT_TARGET, None):  # warm-up: onnxruntime's first runs are slow
                SpeculativeDecoder(card, target, draft=draft).generate(
                    inputs[0], min(16, new_tokens), stop_token_ids=[]
                )
            onnx = result["onnx_target"]
            onnx["draft_adaptive"] = speculate(card, "adaptive", DRAFT_TARGET)
            onnx["lookup_adaptive"] = speculate(card, "adaptive", None)
            onnx["fixed_k"] = {str(k): speculate(card, k, DRAFT_TARGET) for k in ks}
            best = max(onnx["fixed_k"], key=lambda k: onnx["fixed_k"][k]["tokens_per_s"])
            onnx["best_fixed_k"] = int(best)
            onnx["adaptive_vs_best_fixed"] = round(
                onnx["draft_adaptive"]["tokens_per_s"] / onnx["fixed_k"][best]["tokens_per_s"], 3
            )
            if hf:
                result["hf_target"] = _hf_side_by_side(card, inputs, new_tokens, max(ks))
    if users:  # after the host is unpinned: these place their own processes
        from exstill_sdk.bench.decode import users as by_users

        result["users"] = by_users.run(
            users=users,
            ks=users_ks,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            repeats=users_repeats,
            progress=progress,
        )
    if sizes:
        from exstill_sdk.bench.decode import sizes as by_size

        result["sizes"] = by_size.run(
            sizes,
            prompts=prompts,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            runs=size_runs,
            max_k=max(ks),
            progress=progress,
        )
    return result


def _hf_side_by_side(
    card: Any, inputs: list[list[int]], new_tokens: int, max_k: int
) -> dict[str, Any]:
    """transformers' greedy generate, its assisted generation, and ours with the same HF
    target, each after one warm-up call. torch gets one thread for all three, on the host's
    core: the emulated card has the other, as a card brings its own silicon."""
    import torch

    from exstill_sdk.adapters.hf import HFTarget
    from exstill_sdk.image import open_image
    from exstill_sdk.image.hf import to_hf_model
    from exstill_sdk.speculative import SpeculativeDecoder

    data = demo_dir()
    target = to_hf_model(open_image(data / "target.img"), "sdpa")
    draft = to_hf_model(open_image(data / "draft.img"), "sdpa")
    for model in (target, draft):
        model.generation_config.eos_token_id = None  # every run makes new_tokens tokens
        model.generation_config.pad_token_id = 0
    n_out = new_tokens * len(inputs)

    def hf_generate(prompt: list[int], **kwargs: Any) -> list[int]:
        x = torch.tensor([prompt])
        with torch.inference_mode():
            out = target.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                **kwargs,
            )
        return out[0, len(prompt) :].tolist()

    decoder = SpeculativeDecoder(card, HFTarget(target), draft=DRAFT_TARGET, max_k=max_k)
    runs: dict[str, Callable[[list[int]], list[int]]] = {
        "plain": hf_generate,
        "hf_assisted": lambda p: hf_generate(p, assistant_model=draft),
        "exstill": lambda p: decoder.generate(p, new_tokens, stop_token_ids=[]).tokens,
    }
    out: dict[str, Any] = {"torch_threads": 1}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out["verify_us"] = verify_curve(HFTarget(target), inputs[0], range(1, max_k + 2), 5)
    reference: list[list[int]] = []
    for name, fn in runs.items():
        fn(inputs[0])  # warm-up
        seconds, outs = 0.0, []
        for p in inputs:
            s, tokens = timed(fn, p)
            seconds += s
            outs.append(tokens)
        reference = reference or outs
        out[name] = {"tokens_per_s": round(n_out / seconds, 1), "exact": outs == reference}
    torch.set_num_threads(threads)
    out["exstill_vs_plain"] = round(
        out["exstill"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 2
    )
    out["exstill_vs_hf_assisted"] = round(
        out["exstill"]["tokens_per_s"] / out["hf_assisted"]["tokens_per_s"], 2
    )
    out["hf_assisted_vs_plain"] = round(
        out["hf_assisted"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 2
    )
    return out
