"""Benchmarks of the link: a round's host cost and bytes, the host's loop, flashing."""
