"""Benchmarks of the card's transformer engine."""
