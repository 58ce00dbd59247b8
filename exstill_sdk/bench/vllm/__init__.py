"""The card in vLLM against vLLM's own speculative methods."""
