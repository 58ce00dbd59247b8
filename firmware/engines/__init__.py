"""Draft engines: the interface (base.py) and the built-in engines, found by name."""

from __future__ import annotations

from exstill_sdk.errors import UnknownModelError

from .base import ContextState, DraftEngine, EngineState, Proposal, Sampling
from .lookup import LookupEngine

BUILTIN_ENGINES: dict[str, type[DraftEngine]] = {"lookup": LookupEngine}


def builtin_engine(name: str) -> DraftEngine:
    """A built-in engine by name; UnknownModelError lists the known names."""
    try:
        return BUILTIN_ENGINES[name]()
    except KeyError:
        raise UnknownModelError(
            f"no built-in engine {name!r}; known: {', '.join(sorted(BUILTIN_ENGINES))}"
        ) from None


__all__ = [
    "BUILTIN_ENGINES",
    "ContextState",
    "DraftEngine",
    "EngineState",
    "LookupEngine",
    "Proposal",
    "Sampling",
    "builtin_engine",
]
