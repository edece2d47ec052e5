"""Distillation: a step's batch, divergences, objectives, phases, pieces, the on-policy check."""
