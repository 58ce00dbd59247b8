"""Timing like a card, shared by the demo and the benchmarks: the emulated card in a process
of its own on its own core (card_process.py, placement.py), the target beside it, runs
alternated and summarised by median and range (speedup.py, timing.py)."""
