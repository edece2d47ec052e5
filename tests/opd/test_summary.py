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


def test_summary_gives_the_measured_seconds_against_cached_ar_of_the_timed_calls():
    """rollout_vs_ar: the engine's seconds over Cached AR's, summed over the student calls
    Cached AR ran again (ar_rollout_s > 0) only."""
    from opd.run.summary import summarize
    rows = [dict(_row(1, "on", "student", 20, 64, 256, 0.5), ar_rollout_s=0.8,
                 engine_rollout_s=0.4),
            dict(_row(2, "on", "student", 20, 64, 256, 0.7), ar_rollout_s=0.0,
                 engine_rollout_s=0.0),
            dict(_row(3, "on", "student", 20, 64, 256, 0.5), ar_rollout_s=1.2,
                 engine_rollout_s=0.6)]
    s = summarize(rows)
    assert s["rollout_vs_ar"] == pytest.approx(1.0 / 2.0) and s["rollout_vs_ar_calls"] == 2
    assert "rollout_vs_ar" not in summarize(rows[1:2])


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


def test_a_timed_call_runs_cached_ar_again_on_the_same_tokens(tiny_overrides):
    """`rollout.compare_every`: a due batch's stats carry Cached AR's seconds for the same call,
    others none; a Cached AR run times nothing."""
    from opd.config.schema import load_config
    from opd.distill.steps import RolloutJob, build_engine, generate
    from opd.models.factory import load_role_model
    cfg = load_config("tiny", [*tiny_overrides, "rollout.compare_every=2",
                               "rollout.decoding=sample"])
    model = load_role_model(cfg, "student", progress=False)
    labels = torch.tensor([0, 1, 2])
    T = model.block_size

    def job(batch_id):
        return RolloutJob(batch_id, labels, torch.zeros(3, T, dtype=torch.long), 0, "student",
                          cfg.run.seed)
    engine = build_engine(cfg)
    assert generate(model, engine, job(4), cfg, 0).rollout_stats.ar_seconds > 0
    assert generate(model, engine, job(3), cfg, 0).rollout_stats.ar_seconds == 0
    ar = load_config("tiny", [*tiny_overrides, "rollout.compare_every=2",
                              "rollout.engine=cached_ar"])
    assert generate(model, build_engine(ar), job(4), ar, 0).rollout_stats.ar_seconds == 0


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


def test_cached_ar_times_a_streamed_call_before_the_call_runs(tiny_overrides, monkeypatch):
    """A streamed rollout call (`PartStream`, both run modes) times Cached AR before its own
    engine runs, so its report follows its last piece at once (a Ray driver may train and
    summarise the step on the pieces), and the report carries Cached AR's seconds."""
    from opd.config.schema import load_config
    from opd.distill import steps
    from opd.distill.steps import RolloutJob, build_engine
    from opd.distill.stream import PartStream
    from opd.models.factory import load_role_model
    cfg = load_config("tiny", [*tiny_overrides, "rollout.compare_every=1",
                               "rollout.decoding=sample"])
    model = load_role_model(cfg, "student", progress=False)
    order = []
    real = steps.build_engine

    def recording(cfg, name=None):
        engine = real(cfg, name)
        if name == "cached_ar":
            generate = engine.generate
            engine.generate = lambda *a, **k: (order.append("cached_ar"), generate(*a, **k))[1]
        return engine
    monkeypatch.setattr(steps, "build_engine", recording)
    engine = build_engine(cfg)
    stream_call = engine.stream

    def stream(*a, **k):
        order.append("engine")
        return stream_call(*a, **k)
    engine.stream = stream
    T = model.block_size
    job = RolloutJob(1, torch.tensor([0, 1, 2, 3]), torch.zeros(4, T, dtype=torch.long), 0,
                     "student", cfg.run.seed)
    part = PartStream(model, engine, job, cfg, 0, [2, 2])
    pieces = []
    for piece in part:
        pieces.append((piece.index, list(order)))
    assert order == ["cached_ar", "engine"]
    assert sorted(i for i, _ in pieces) == [0, 1] and all(o == order for _, o in pieces)
    assert part.stats.ar_seconds > 0
