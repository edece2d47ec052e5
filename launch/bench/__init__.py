"""Benchmarks behind `opd bench <what>`; they drive both run modes, so they sit in the top layer.

    grid         the engine grid the next three measure: engines on the same inputs, timed
                 interleaved, tokens checked against Cached AR (grid.py; its presets' keys)
    rollout      engines x windows x batches x decodings against Cached AR (rollout.py)
    step         one OPD step split into stages, reference and Ray (step.py, step_io.py)
    paper        the paper's ablations on one preset (paper.py, paper_measure.py,
                 paper_report.py; synthetic.py makes their stand-in data)
    table1       the paper's Table 1 rollout rows, Cached AR against HB-SJD, of run
                 configs' rollouts (table1.py)
    schedules    KD-only against the default schedule at equal steps and equal time, and
                 quality against training time (schedules.py, schedules_report.py,
                 schedules_curves.py)
    common       presets, interleaving and the shared table helpers
"""
