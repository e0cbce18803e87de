"""Benchmarks: scripts that print a table and write JSON, results in BENCHMARKS.md. Not tests."""
