"""One vLLM engine, the target with one way of drafting, timed over user counts: the process
that ``exstill-bench vllm`` (bench/vllm/side.py) starts once per target and way, pinned to the
cores that way gets. Run as ``python -m exstill_sdk.bench.vllm.engine`` with the job as JSON on
stdin; prints one JSON line.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the time vLLM's model
runner spends drafting (``propose_draft_token_ids``: the draft model's steps, n-gram lookup, or
the card's round trip) is measured apart from the rest of each step, the target's.

Every user count serves the same prompts, U at a time (``serve``), so each load decodes the
same text: one warm-up on the first U, then ``repeats`` timed runs. vLLM's speculative-decoding
counters are read before and after each timed run, and for the card's ways the card's prefetch
counters too (STATS over a connection of the bench's own: the card serves one engine at a
time, so what they add is this run's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack
from typing import Any

from exstill_sdk.support.prefetch import prefetch_counts

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

METHODS = ("alone", "ngram", "draft_model", "card")
PROPOSER = "exstill_sdk.adapters.vllm.ExstillProposer"


class _DraftClock:
    """Seconds vLLM's model runner spends drafting, and the steps it runs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        propose = GPUModelRunner.propose_draft_token_ids
        execute = GPUModelRunner.execute_model
        clock = self

        def timed_propose(runner: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return propose(runner, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - started

        def counted_execute(runner: Any, *args: Any, **kwargs: Any) -> Any:
            clock.steps += 1
            return execute(runner, *args, **kwargs)

        GPUModelRunner.propose_draft_token_ids = timed_propose  # type: ignore[method-assign]
        GPUModelRunner.execute_model = counted_execute  # type: ignore[method-assign]


def speculative_config(job: dict[str, Any]) -> dict[str, Any]:
    """The engine's arguments for the job's way of drafting."""
    method, k = job["method"], int(job["k"])
    if method == "alone":
        return {}
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k}
        spec.update(job.get("ngram", {}))
        return {"speculative_config": spec}
    if method == "draft_model":
        return {
            "speculative_config": {
                "method": "draft_model",
                "model": job["draft"],
                "num_speculative_tokens": k,
                "draft_tensor_parallel_size": 1,
            }
        }
    if method == "card":
        return {
            "speculative_config": {
                "method": "custom_class",
                "model": PROPOSER,
                "num_speculative_tokens": k,
            },
            "additional_config": {"exstill": {"url": job["card"], **job.get("exstill", {})}},
        }
    raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")


def _counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(
                m, "value", getattr(m, "values", None)
            )
    return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old, strict=True)]
        else:
            out[name] = value - (old or 0)
    return out


def serve(llm: Any, prompts: list[list[int]], users: int, new_tokens: int) -> dict[str, Any]:
    """Serve ``prompts`` ``users`` at a time (greedy, ``new_tokens`` each), stepping vLLM's
    engine: the outputs, and tokens/s while every user of a group is decoding (from the step
    in which the last of the group has its first token to the one in which the first has all
    its tokens, summed over the groups) and over everything."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    window_tokens, window_s = 0, 0.0
    started = time.perf_counter()
    for first in range(0, len(prompts), users):
        group = range(first, min(first + users, len(prompts)))
        for i in group:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        counts: dict[str, int] = {}
        start: tuple[float, int] | None = None
        end: tuple[float, int] | None = None
        while engine.has_unfinished_requests():
            step = engine.step()
            now = time.perf_counter()
            for out in step:
                tokens = list(out.outputs[0].token_ids)
                counts[out.request_id] = len(tokens)
                if out.finished:
                    outputs[int(out.request_id)] = tokens
            if start is None and len(counts) == len(group):
                start = (now, sum(counts.values()))
            if start is not None and end is None and any(int(r) in outputs for r in counts):
                end = (now, sum(counts.values()))
        if start is not None and end is not None and end[0] > start[0]:
            window_tokens += end[1] - start[1]
            window_s += end[0] - start[0]
    seconds = time.perf_counter() - started
    tokens = [outputs[i] for i in range(len(prompts))]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "decode_tokens_per_s": window_tokens / window_s if window_s else 0.0,
        "overall_tokens_per_s": sum(len(t) for t in tokens) / seconds,
    }


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Load the engine and time every user count of the job."""
    from vllm import LLM

    clock = _DraftClock()
    clock.install()
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        max_model_len=int(job["max_model_len"]),
        dtype=job.get("dtype", "float32"),  # vLLM would run an f32 checkpoint in bf16
        enforce_eager=True,
        enable_prefix_caching=False,  # every repeat does the same work
        disable_log_stats=False,
        seed=0,
        **speculative_config(job),
    )
    load_s = time.perf_counter() - started
    prompts, new_tokens = job["prompts"], int(job["new_tokens"])
    rows = []
    with ExitStack() as stack:
        card = None
        if job["method"] == "card":
            from exstill_sdk.card import open_card

            card = stack.enter_context(open_card(job["card"]))
        for users in job["users"]:
            serve(llm, prompts[:users], users, int(job["warm_up_tokens"]))
            runs = []
            for _ in range(int(job["repeats"])):
                before, draft_s, steps = _counters(llm), clock.seconds, clock.steps
                card_before = card.stats() if card is not None else {}
                result = serve(llm, prompts, users, new_tokens)
                result["counters"] = _delta(_counters(llm), before)
                result["draft_seconds"] = clock.seconds - draft_s
                result["steps"] = clock.steps - steps
                if card is not None:
                    result["card_prefetch"] = prefetch_counts(card.stats(), card_before)
                runs.append(result)
            rows.append({"users": users, "runs": runs})
    return {"method": job["method"], "load_s": load_s, "rows": rows}


def main() -> None:
    job = json.loads(sys.stdin.read())
    result = run(job)
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
