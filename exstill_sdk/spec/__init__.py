"""Speculative decoding with an Exstill card: the decoder, acceptance rules, K policies,
metrics, and the TargetAdapter interface a target implements."""

from exstill_sdk.spec.adapter import TargetAdapter
from exstill_sdk.spec.adaptive import AdaptiveK, FixedK, KPolicy
from exstill_sdk.spec.decoder import GenerationResult, SpeculativeDecoder
from exstill_sdk.spec.metrics import SpecMetrics
from exstill_sdk.spec.sampling import SamplingParams, target_probs

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
