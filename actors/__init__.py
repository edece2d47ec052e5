"""Ray actors and the driver of distributed OPD (imports ray; deepspeed only in learner.py).

    from actors.pipeline import run_distributed
    rows = run_distributed(cfg, run_dir)        # same rows as opd.reference.run_reference

pipeline.py  the driver: step flow, overlap, faults, checkpoints, consumed-ids record
cluster.py   Ray connection, placement groups, starting / stopping the actor groups
rollout_worker.py, teacher_worker.py, learner.py (DeepSpeed), queue.py (TrajectoryQueue)
weights.py   student weights to rollout workers (object store or broadcast group)
shards.py    sub-batches of a step and data-parallel shards;  pool.py  worker health
metrics.py   Ray metrics (ray.util.metrics) by role and worker
"""
