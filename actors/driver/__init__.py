"""The driver of a distributed run: `pipeline.run_distributed` executes the decisions of
`core.py` (plain functions over typed state, no Ray) with its parts — planner.py, dispatch.py,
publisher.py, records.py, elastic.py, pool.py, tasks.py — and starts the actors (cluster.py);
group.py fans one call out to a group, interrupt.py defers Ctrl-C to a checkpoint."""
