"""The draft's starting point: the target itself with most of its layers left out.

The card runs one architecture (``exstill-decoder-v1``, docs/image-format.md), which every
supported target family already is, so the draft is the target's own model class with
``layers`` decoder layers: the target's embedding, final norm and output head, and its layers
at evenly spaced depths (the first and the last always among them). It starts close to the
target, in its tokenizer and its representation, and training (train.py) closes the rest.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from exstill_sdk.errors import InvalidArgumentError


def kept_layers(total: int, layers: int) -> list[int]:
    """Indices of ``layers`` of ``total`` layers at evenly spaced depths, first and last
    included."""
    if not 1 <= layers <= total:
        raise InvalidArgumentError(f"--layers must be 1..{total} (the target's layers)")
    if layers == 1:
        return [0]
    return sorted({round(float(x)) for x in np.linspace(0, total - 1, layers)})


def draft_from_target(target: Any, layers: int) -> Any:
    """A new model of the target's class and config with ``layers`` of its layers, copied, on
    the target's device."""
    config = copy.deepcopy(target.config)
    total = config.num_hidden_layers
    keep = kept_layers(total, layers)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = len(keep)
    draft = type(target)(config)
    source, dest = target.model, draft.model
    dest.embed_tokens.load_state_dict(source.embed_tokens.state_dict())
    dest.norm.load_state_dict(source.norm.state_dict())
    for i, j in enumerate(keep):
        dest.layers[i].load_state_dict(source.layers[j].state_dict())
    if not config.tie_word_embeddings:
        draft.lm_head.load_state_dict(target.lm_head.state_dict())
    return draft.float().to(target.device)
