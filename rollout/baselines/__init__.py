"""The paper's baselines, kept for comparison only: no training run uses them.

    sjd_sync.py          Batch-Synchronous SJD (the original SJD batched naively: the batch
                         minimum, its own verification step `sync_update`)
    sjd_independent.py   Independent Batched SJD (HB-SJD's round, Full execution always)

Cached AR (rollout/cached_ar.py) is the other baseline but stays beside the engines: training
uses it too (opd/distill/steps.py times every tenth rollout call with it for the summary's
rollout_vs_ar, and `rollout.engine=cached_ar` is a supported run).
"""
