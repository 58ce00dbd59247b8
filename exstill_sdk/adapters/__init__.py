"""Target adapters: a packed image run by onnxruntime (``onnx``), a transformers causal LM
(``hf``), and vLLM's proposer interface (later). Each implements
exstill_sdk.speculative.TargetAdapter."""
