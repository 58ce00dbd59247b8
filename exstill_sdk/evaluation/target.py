"""A target named by a path (an HF checkpoint directory or a GGUF file) run by transformers on
the CPU: loading it, a prompt's ids, its greedy continuation. Shared by ``exstill eval`` and
``exstill distill``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.evaluation.prompts import Prompt


def _source(path: str | Path) -> tuple[Path, dict[str, str]]:
    """Where transformers loads a target from, and the extra argument a GGUF file needs."""
    from exstill_sdk.image.gguf_file import is_gguf

    p = Path(path)
    if is_gguf(p):
        return p.parent, {"gguf_file": p.name}
    if p.is_dir():
        return p, {}
    raise InvalidArgumentError(f"{p}: give the target as an HF checkpoint directory or a GGUF file")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise InvalidArgumentError(
            "exstill eval runs the target with transformers: pip install 'exstill-sdk[hf]' "
            "(torch==2.13.0 first on a CPU machine)"
        ) from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def load_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer, from an HF checkpoint directory or a GGUF file."""
    where, extra = _source(path)
    try:
        return _transformers().AutoTokenizer.from_pretrained(where, **extra)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(
            f"cannot load the target's tokenizer from {path}: {exc}"
        ) from None


def torch_device(name: str = "auto") -> str:
    """The torch device ``name`` stands for: ``auto`` is the first CUDA GPU where torch sees
    one, else the CPU; ``cpu``, ``cuda`` or ``cuda:N`` as given, once checked to exist."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    head, _, index = name.partition(":")
    if head != "cuda" or (index and not index.isdigit()):
        raise InvalidArgumentError(f"--device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"--device {name}: torch sees no CUDA GPU here (a CPU build of torch, or no "
            "driver); use --device cpu"
        )
    if index and int(index) >= torch.cuda.device_count():
        raise InvalidArgumentError(
            f"--device {name}: torch sees {torch.cuda.device_count()} CUDA GPU(s), numbered from 0"
        )
    return name


def load_model(path: str | Path, device: str = "cpu") -> Any:
    """The target as a transformers causal LM (float32, in eval mode) on ``device`` (a torch
    device, as ``torch_device`` gives)."""
    import torch

    where, extra = _source(path)
    try:
        model = _transformers().AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, **extra
        )
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot load the target from {path}: {exc}") from None
    return model.to(device).eval()


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's ids: as the user's turn of the tokenizer's chat template where it has one,
    else the text as it is."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt.text)["input_ids"]]


def continuation_logits(model: Any, prompt: list[int], continuation: list[int]) -> Any:
    """``model``'s logits (a float32 torch tensor [len(continuation), vocab], on the CPU) for
    each continuation token, given the prompt and the continuation before it: one forward
    pass."""
    import torch

    ids = torch.tensor([prompt + continuation[:-1]], dtype=torch.long, device=model.device)
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1 :].float().cpu()


def greedy_continuation(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation of ``prompt``, ``new_tokens`` long or up to its end of
    text."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=model.generation_config.eos_token_id or 0,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
