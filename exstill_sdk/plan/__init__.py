"""The deployment planner: what the card will do for a target, its GPUs and its users.

Profiles in (``profiles``: the target's pass costs, the card's drafting; ``acceptance``: how
far drafts are accepted), a virtual-time simulation of U users out (``simulate``). It reads
data and never imports the SDK's hot path; docs/planning.md has the model and the schema.
"""

from exstill_sdk.plan.acceptance import Acceptance, load_acceptance
from exstill_sdk.plan.profiles import (
    CardProfile,
    ProfileError,
    TargetProfile,
    load_card,
    load_target,
)
from exstill_sdk.plan.shapes import DraftShape, chain_shape, tree_shape
from exstill_sdk.plan.simulate import Projection, plan, simulate

__all__ = [
    "Acceptance",
    "CardProfile",
    "DraftShape",
    "ProfileError",
    "Projection",
    "TargetProfile",
    "chain_shape",
    "load_acceptance",
    "load_card",
    "load_target",
    "plan",
    "simulate",
    "tree_shape",
]
