"""Benchmarks of decoding: plain against speculative, end to end, by size and by users."""
