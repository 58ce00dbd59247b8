"""Benchmarks behind ``exstill-bench``; each returns a dict of figures."""
