"""Benchmarks: scripts that print a table and write JSON (DESIGN.md, Benchmarks). Not tests."""
