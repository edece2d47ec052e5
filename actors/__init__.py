"""Ray actors and the driver of distributed OPD (imports ray; deepspeed only in
workers/learner.py).

    from actors.driver.pipeline import run_distributed
    rows = run_distributed(cfg, run_dir)        # same rows as opd.run.reference.run_reference

Layers, roles, one step's data flow, the module map and the numbered invariants:
docs/ARCHITECTURE.md.  By role:

    driver/         the process that ran `opd train`: its decisions (core.py) and their executor
                    (pipeline.py), plans, dispatch, weight publishing, records, the cluster
    workers/        the actors: rollout, teacher, learner (DeepSpeed), evaluation, the trajectory
                    queue, and their base (base.py: device, name, info, weight loading)
    transport/      what travels between them: weights, delivered parts, shards, payload bytes
    bench/          the `opd bench` helpers that need Ray (per-role bytes, weight-sync timing)
    ray_metrics.py  Ray metrics (ray.util.metrics) by role and worker

Imports go driver -> workers -> transport (tests/test_layering.py: no cycles).
"""
