"""The paper's baselines, kept for comparison: no training preset runs them (configs/bench does).

    sjd_sync.py          Batch-Synchronous SJD (the original SJD batched naively: the batch
                         minimum, its own verification step `sync_update`)
    sjd_independent.py   Independent Batched SJD (HB-SJD's round, Full execution always)

Cached AR (rollout/cached_ar.py) is the other baseline but stays beside the engines: training
runs it too (opd/distill/steps.py `ar_timed`: with `rollout.compare_every`, by default every
tenth rollout call is run by it in the engine's place, for the summary's rollout_vs_ar; and
`rollout.engine=cached_ar` is a run of its own).
"""
