"""The closing quality table of `opd train`: teacher, student before / after, gap closed."""
import pytest
import torch

from opd.run.summary import gap_share, gap_table, write_quality_summary

ROWS = [  # made-up quality.parquet rows, not in step order
    {"step": 0, "role": "teacher", "fid": 10.0, "precision": 0.8, "recall": 0.6,
     "class_acc": 0.9, "kl_data": 0.0},
    {"step": 50, "role": "student", "fid": 40.0, "precision": 0.5, "recall": 0.35,
     "class_acc": 0.6, "kl_data": 0.3, "kl_samples": 0.5},
    {"step": 0, "role": "student", "fid": 50.0, "precision": 0.4, "recall": 0.2,
     "class_acc": 0.5, "kl_data": 0.4, "kl_samples": 0.8},
    {"step": 100, "role": "student", "fid": 30.0, "precision": 0.7, "recall": 0.7,
     "class_acc": 0.8, "kl_data": 0.1, "kl_samples": 0.2},
]


def test_gap_table_exact_shares():
    lines = gap_table(ROWS).splitlines()
    assert lines[0] == ("| | teacher | student before (step 0) | student after (step 100) | "
                        "share of the gap closed |")
    assert lines[2:] == [
        "| FID ↓ | 10.00 | 50.00 | 30.00 | 50.0% |",                 # (50-30)/(50-10)
        "| precision ↑ | 0.8000 | 0.4000 | 0.7000 | 75.0% |",         # (0.4-0.7)/(0.4-0.8)
        "| recall ↑ | 0.6000 | 0.2000 | 0.7000 | 125.0% |",           # passed the teacher
        "| class accuracy ↑ | 0.9000 | 0.5000 | 0.8000 | 75.0% |",
        "| held-out KL(T‖S) ↓ | 0.0000 | 0.4000 | 0.1000 | 75.0% |",   # teacher: 0
        "| on-policy KL(T‖S) ↓ | 0.0000 | 0.8000 | 0.2000 | 75.0% |",  # (0.8-0.2)/0.8
    ]


def test_gap_table_headers_count_the_samples_of_each_column():
    rows = [{**r, "samples": 1000 if r["role"] == "student" else 200} for r in ROWS]
    assert gap_table(rows).splitlines()[0] == (
        "| | teacher (200 samples) | student before (step 0, 1,000 samples) | student after "
        "(step 100, 1,000 samples) | share of the gap closed |")


def test_gap_share():
    assert gap_share(10.0, 50.0, 30.0) == pytest.approx(0.5)
    assert gap_share(10.0, 50.0, 60.0) == pytest.approx(-0.25)    # moved away
    assert gap_share(0.0, 0.4, 0.0) == 1.0
    assert gap_share(10.0, 10.0, 5.0) is None                     # no gap to close
    assert gap_share(None, 0.5, 0.6) is None
    assert gap_share(0.9, float("nan"), 0.6) is None


def test_gap_table_without_class_accuracy_or_teacher():
    rows = [{**r, "class_acc": None} for r in ROWS if r["role"] == "student"]
    lines = gap_table(rows).splitlines()
    assert lines[5] == "| class accuracy ↑ | — | — | — | — |"         # not digits
    assert lines[2] == "| FID ↓ | — | 50.00 | 30.00 | — |"
    assert lines[6] == "| held-out KL(T‖S) ↓ | 0.0000 | 0.4000 | 0.1000 | 75.0% |"
    assert gap_table([ROWS[0]]) == ""                             # no student evaluated


def test_write_quality_summary(tmp_path):
    from opd.eval.tracking import quality_log
    log = quality_log(tmp_path)
    for r in ROWS:
        log.append(r)
    table = write_quality_summary(tmp_path)
    assert table == gap_table(ROWS)
    assert table in (tmp_path / "quality.md").read_text()
    assert write_quality_summary(tmp_path / "nothing") == ""


def _row(step, phase, source, rounds=0, ar_rounds=0, gen=0, roll=0.0):
    return {"step": step, "phase": phase, "source": source, "loss": 1.0 + step, "rounds": rounds,
            "ar_rounds": ar_rounds, "generated_tokens": gen, "rollout_s": roll,
            "rollout_tokens_per_s": gen / roll if roll else 0.0, "mean_committed": 2.0 if gen else 0.0,
            "teacher_s": 0.1, "learner_s": 0.2, "step_s": 0.5 + roll}


def test_summary_names_phases_and_gives_rollout_figures_only_for_rollouts(tmp_path):
    from opd.run.artifacts import plot_training
    from opd.run.summary import phase_spans, summarize
    kd = [_row(s, "warm", "data") for s in range(3)]
    on = [_row(3, "onpolicy", "student", 20, 64, 256, 0.5),
          _row(4, "onpolicy", "data"),
          _row(5, "onpolicy", "student", 30, 64, 256, 1.5)]
    assert phase_spans(kd + on) == [("warm", 0, 2, 0), ("onpolicy", 3, 5, 2)]
    s = summarize(kd + on)
    assert s["student_steps"] == 2 and s["rounds_vs_ar"] == 50 / 128
    assert s["rollout_tokens_per_s"] == 512 / 2.0 and s["rollout_s"] == 1.0
    assert not {"student_steps", "rollout_s", "rollout_tokens_per_s", "mean_committed",
                "rounds_vs_ar"} & set(summarize(kd))
    assert plot_training(kd + on, tmp_path / "a.png") == tmp_path / "a.png"
    assert plot_training(kd, tmp_path / "b.png") == tmp_path / "b.png"


def test_summary_prices_the_engines_calls_by_cached_ars_calls_of_the_same_shape():
    """rollout_vs_ar: the engine's seconds over its calls against Cached AR's mean seconds for
    calls of their shape (prefix length, tokens generated), from the calls Cached AR ran in
    the engine's place (ar_rollout_s > 0); a shape Cached AR never ran is left out, and the
    rounds figures are the engine's calls' only.  rollout_vs_ar_cpu: the same on the calls'
    CPU seconds (a one-thread CPU rollout), none where they were not recorded."""
    from opd.run.summary import summarize

    def call(step, prefix, gen, engine=0.0, ar=0.0, rounds=20):
        return dict(_row(step, "on", "student", rounds, 64, gen, 0.5), prefix_len=prefix,
                    engine_rollout_s=engine, ar_rollout_s=ar, engine_rollout_cpu_s=engine / 2,
                    ar_rollout_cpu_s=ar / 4)
    rows = [call(0, 0, 256, ar=0.8, rounds=64), call(1, 0, 256, ar=1.2, rounds=64),  # AR: 1.0
            call(2, 32, 128, ar=0.5, rounds=64),                                    # AR: 0.5
            call(3, 0, 256, engine=0.6), call(4, 0, 256, engine=1.0),
            call(5, 32, 128, engine=0.4),
            call(6, 16, 192, engine=9.0)]                      # a shape Cached AR never ran
    s = summarize(rows)
    assert s["rollout_vs_ar"] == pytest.approx((0.6 + 1.0 + 0.4) / (1.0 + 1.0 + 0.5))
    assert s["rollout_vs_ar_cpu"] == pytest.approx((0.6 + 1.0 + 0.4) / 2 / ((1.0 + 1.0 + 0.5) / 4))
    assert s["rollout_vs_ar_calls"] == 3 and s["rollout_vs_ar_priced"] == 3
    assert s["rounds_vs_ar"] == pytest.approx(4 * 20 / (4 * 64))
    assert "rollout_vs_ar" not in summarize(rows[3:])
    wall_only = [{k: v for k, v in r.items() if "cpu" not in k} for r in rows]
    assert summarize(wall_only)["rollout_vs_ar"] == s["rollout_vs_ar"]
    assert "rollout_vs_ar_cpu" not in summarize(wall_only)
    assert "rollout_vs_ar" not in summarize(rows[:3] + rows[6:])


def test_summary_gives_an_onpolicy_updates_cost_and_the_teachers_time_in_rollouts():
    """onpolicy_vs_data: mean step seconds on student rollouts (fresh or reused) over those on
    data; teacher_in_rollout: span-scored teacher seconds during the calls over all of them."""
    from opd.run.summary import summarize
    rows = [dict(_row(0, "w", "data"), step_s=0.1, teacher_busy_s=0.05),
            dict(_row(1, "w", "data"), step_s=0.3, teacher_busy_s=0.05),
            dict(_row(2, "on", "student", 20, 64, 256, 0.5), step_s=0.5, teacher_busy_s=0.2,
                 teacher_in_rollout_s=0.15),
            dict(_row(3, "on", "student"), step_s=0.1, reused=True, teacher_busy_s=0.0)]
    s = summarize(rows)
    assert s["onpolicy_vs_data"] == pytest.approx(0.3 / 0.2)
    assert s["teacher_in_rollout"] == pytest.approx(0.75)
    assert "teacher_in_rollout" not in summarize(rows[:2]) and "onpolicy_vs_data" not in summarize(rows[2:])


def test_a_timed_call_is_run_by_cached_ar_in_the_engines_place(tiny_overrides):
    """`rollout.compare_every` 2: a due batch's call (ids 1, 3, 5, ...) is run by Cached AR, timed (its stats'
    ar_seconds are its own seconds), and hands out the tokens the engine would have (and their
    log-probs, to float32 rounding: another forward's shape; no loss reads them); others run the engine and time nothing; a Cached AR run, a speculative one and a
    SeqKD teacher rollout time nothing."""
    from opd.config.schema import load_config
    from opd.distill.steps import RolloutJob, build_engine, generate
    from opd.models.factory import load_role_model
    over = [*tiny_overrides, "rollout.decoding=sample"]
    cfg = load_config("tiny", [*over, "rollout.compare_every=2"])
    model = load_role_model(cfg, "student", progress=False)
    labels = torch.tensor([0, 1, 2])
    T = model.block_size

    def job(batch_id, source="student"):
        return RolloutJob(batch_id, labels, torch.zeros(3, T, dtype=torch.long), 0, source,
                          cfg.run.seed)
    engine = build_engine(cfg)
    timed = generate(model, engine, job(5), cfg, 0)
    s = timed.rollout_stats
    assert s.engine == "cached_ar" and s.ar_seconds == s.rollout_seconds > 0
    assert s.rounds == s.ar_rounds                                  # one token a round
    row = s.row()                                   # one thread: its CPU seconds, as AR's
    assert row["ar_rollout_cpu_s"] == s.cpu_seconds and row["engine_rollout_cpu_s"] == 0
    assert 0 < s.cpu_seconds <= s.rollout_seconds + 1e-3
    untimed = generate(model, engine, job(5), load_config("tiny", over), 0)
    assert untimed.rollout_stats.engine == "hbsjd" and untimed.rollout_stats.ar_seconds == 0
    row, u = untimed.rollout_stats.row(), untimed.rollout_stats
    assert row["engine_rollout_cpu_s"] == u.cpu_seconds and row["ar_rollout_cpu_s"] == 0
    assert 0 < u.cpu_seconds <= u.rollout_seconds + 1e-3
    assert torch.equal(timed.tokens, untimed.tokens)
    assert torch.allclose(timed.behaviour_logprobs, untimed.behaviour_logprobs, atol=1e-5)
    assert generate(model, engine, job(4), cfg, 0).rollout_stats.ar_seconds == 0   # not due
    for other in (["rollout.engine=cached_ar"], ["rollout.decoding=speculative"]):
        c = load_config("tiny", [*tiny_overrides, "rollout.compare_every=2", *other])
        assert generate(model, build_engine(c), job(5), c, 0).rollout_stats.ar_seconds == 0
    assert generate(model, engine, job(5, "teacher"), cfg, 0).rollout_stats.ar_seconds == 0


def test_stage_lines_give_each_stage_busy_time_and_the_critical_path():
    from opd.run.summary import stage_lines
    student = dict(source="student", pieces=4, rollout_busy_s=0.1, teacher_busy_s=0.05,
                   learner_busy_s=0.05)
    data = dict(source="data", pieces=1, rollout_busy_s=0.0, teacher_busy_s=0.1,
                learner_busy_s=0.1)
    rows = [{**student, "step_s": s} for s in (0.1, 0.12, 0.5)] + \
           [{**data, "step_s": s} for s in (0.25, 0.3)]
    assert stage_lines(rows) == [
        "steps on student rollouts (3, 4 pieces): rollout + teacher + learner busy "
        "0.100 + 0.050 + 0.050 = 0.200 s; a step took 0.120 s, 0.60x the busy sum: the stages "
        "overlapped (medians)",
        "steps on data (2, 1 piece): teacher + learner busy 0.100 + 0.100 = 0.200 s; a step "
        "took 0.275 s, 1.38x the busy sum: the stages ran one after another (medians)"]
    reference = [{"source": "student", "step_s": 0.1, "rollout_s": 0.05}]   # no busy columns
    assert stage_lines(reference) == []


def test_window_lines_add_the_rounds_of_each_window_over_student_rollouts():
    from opd.run.summary import window_lines
    rows = [{"source": "student", "window_hist": [2, 0, 0, 5]},
            {"source": "data", "window_hist": None},
            {"source": "student", "window_hist": [1, 3, 0, 0]},
            {"source": "teacher", "window_hist": [0, 0, 0, 9]}]       # SeqKD: not the student's
    assert window_lines(rows) == ["rollout windows (W: rounds): 1: 3, 2: 3, 4: 5"]
    assert window_lines([{"source": "student", "window_hist": None}]) == []


def test_a_streamed_timed_call_is_run_by_cached_ar_and_hands_out_the_same_pieces(
        tiny_overrides):
    """A streamed rollout call (`PartStream`, both run modes) on a batch due for timing is run
    by Cached AR alone (the engine does not run it: no call is run twice, and Cached AR runs
    where the engine's calls do), hands out the same pieces, rows, tokens and log-probs as
    the engine's call (log-probs to float32 rounding), and its report carries Cached AR's
    seconds."""
    from opd.config.schema import load_config
    from opd.distill.steps import RolloutJob, build_engine
    from opd.distill.stream import PartStream
    from opd.models.factory import load_role_model
    over = [*tiny_overrides, "rollout.decoding=sample"]
    cfg = load_config("tiny", [*over, "rollout.compare_every=1"])
    model = load_role_model(cfg, "student", progress=False)
    engine = build_engine(cfg)
    ran = []
    stream_call = engine.stream
    engine.stream = lambda *a, **k: (ran.append("engine"), stream_call(*a, **k))[1]
    T = model.block_size
    job = RolloutJob(1, torch.tensor([0, 1, 2, 3]), torch.zeros(4, T, dtype=torch.long), 0,
                     "student", cfg.run.seed)

    def pieces(c):
        part = PartStream(model, engine, job, c, 0, [2, 2])
        got = sorted(part, key=lambda p: p.index)
        logp = torch.cat([p.batch.behaviour_logprobs for p in got])
        return [(p.index, p.rows.tolist(), p.batch.tokens.tolist()) for p in got], logp, part.stats
    timed, logp, stats = pieces(cfg)
    assert ran == [] and stats.engine == "cached_ar" and stats.ar_seconds > 0
    assert stats.ar_seconds == stats.rollout_seconds and stats.rounds == stats.ar_rounds
    untimed, logp_engine, stats = pieces(load_config("tiny", over))
    assert ran == ["engine"] and stats.ar_seconds == 0
    assert timed == untimed and [i for i, *_ in timed] == [0, 1]
    assert torch.allclose(logp, logp_engine, atol=1e-5)
