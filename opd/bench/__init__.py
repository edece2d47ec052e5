"""Benchmarks behind `opd bench <what>`: rollout engines (rollout.py), more to come."""
