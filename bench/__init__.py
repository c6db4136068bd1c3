"""Benchmarks and their evaluation code (bench/eval): run from a checkout, never installed (the wheel carries no
bench/)."""
