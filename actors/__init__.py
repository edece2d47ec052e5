"""Ray actors and the driver of distributed OPD (imports ray; deepspeed only in learner.py).

    from actors.pipeline import run_distributed
    rows = run_distributed(cfg, run_dir)        # same rows as opd.reference.run_reference

Layers, roles, one step's data flow and the numbered invariants: docs/ARCHITECTURE.md.

pipeline.py  the driver: step flow, overlap, faults, weight publishing
records.py   checkpoints, consumed-ids record, learner failures, Ctrl-C
cluster.py   Ray connection, placement groups, starting / stopping the actor groups, actor
             names (opd/<role>/<index>) in a namespace of the run's own
rollout_worker.py, teacher_worker.py, learner.py (DeepSpeed), queue.py (TrajectoryQueue)
weights.py   student weights to rollout workers (object store or broadcast group)
shards.py    sub-batches of a step and data-parallel shards;  pool.py  worker health
metrics.py   Ray metrics (ray.util.metrics) by role and worker
"""
