"""Running a card image's decoder with onnxruntime: the one implementation the card runtime's
transformer engine and the host's ONNX target adapter share.

graph.py   the ONNX graph built from an image's architecture and tensors (no copy of weights)
runner.py  OnnxDecoder: sessions, the shared KV buffer, forward/prefill over rows
slots.py   SlotRunner: several sequences' tokens in one run
trees.py   TreeRunner: a token tree scored in one run, and one path of it kept
"""

from exstill_sdk.execution.runner import OnnxDecoder

__all__ = ["OnnxDecoder"]
