"""Speculative decoding with an Exstill card: the decoder, acceptance rules, K policies,
metrics, and the TargetAdapter interface a target implements."""

from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.speculative.adaptive import AdaptiveK, FixedK, KPolicy
from exstill_sdk.speculative.decoder import GenerationResult, SpeculativeDecoder
from exstill_sdk.speculative.metrics import SpecMetrics
from exstill_sdk.speculative.sampling import SamplingParams, target_probs

__all__ = [
    "AdaptiveK",
    "FixedK",
    "GenerationResult",
    "KPolicy",
    "SamplingParams",
    "SpecMetrics",
    "SpeculativeDecoder",
    "TargetAdapter",
    "target_probs",
]
