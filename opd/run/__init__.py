"""A run: the reference loop, checkpoints, run directory, metrics, summary, trackers, export."""
