"""Helpers of `opd bench` that need Ray (launch/bench imports no actors: launch/ passes these in):
io.py, a run's bytes by role, peak memory and object-store samples (`opd bench step`);
weights.py, weight-sync timing; memory.py, what a run holds (the soaks' store readings and
their growth check)."""
