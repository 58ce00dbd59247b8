"""Benchmarks behind ``exstill-bench``, grouped by what they measure; each returns a dict of
figures, and each group registers its own sub-commands (``commands.py``):

link/    a round's host cost and bytes on the wire, the host's loop against context, flashing
engine/  the card's transformer engine against HF transformers
decode/  plain against speculative decoding; the demo pair end to end, by size and by users
vllm/    the card inside vLLM against vLLM's own methods

The timing harness they share with the demo is exstill_sdk.harness; the planner's measurements
(exstill-bench profile, exstill plan --check) are exstill_sdk.plan.measure.
"""
