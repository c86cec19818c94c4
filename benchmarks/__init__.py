"""Benchmarks: print a table and write JSON; not timed tests."""
