"""``exstill demo``: the shipped demo pair, speculative decoding against the target alone.

pair.py     the shipped pair: images, tokenizer, the emulated card that drafts with it
targets.py  the small trained target and its memory-bound expansion (built into the cache)
run.py      run_demo: timed like a card, read against the pair's limit on this machine
"""

from exstill_sdk.demo.pair import (
    DRAFT_TARGET,
    POSITIONS,
    THREADS,
    demo_dir,
    demo_tokenizer,
    emulator_args,
    emulator_url,
    held_out_prompts,
)
from exstill_sdk.demo.run import DEFAULT_PROMPT, DemoResult, run_demo
from exstill_sdk.demo.targets import TARGETS, DemoTarget, cache_dir, demo_target, expanded_target

__all__ = [
    "DEFAULT_PROMPT",
    "DRAFT_TARGET",
    "POSITIONS",
    "TARGETS",
    "THREADS",
    "DemoResult",
    "DemoTarget",
    "cache_dir",
    "demo_dir",
    "demo_target",
    "demo_tokenizer",
    "emulator_args",
    "emulator_url",
    "expanded_target",
    "held_out_prompts",
    "run_demo",
]
