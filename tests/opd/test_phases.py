"""distill.phases: the schedule's config, its resolution (opd/distill/phases.py) and the reference loop
across a phase boundary, also resumed there (invariant 8)."""
import pytest

from opd.run import reference
from opd.config.schema import load_config
from opd.config.loader import ConfigError
from opd.distill.phases import learning_rate, objective_at, phase_at, phases, rolls_out
from opd.run.reference import run_reference

WARM_THEN_GKD = ("distill.phases=[{name: warm, steps: 2, objective: kd}, "
                 "{name: onpolicy, objective: gkd, lam: 1.0, lr: 1.0e-3, warmup_steps: 1}]")


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "distill.steps=5", "rollout.engine=cached_ar",
                                "run.checkpoint_every=0", *extra])


def losses(rows):
    return [r["loss"] for r in rows]


# --- config ----------------------------------------------------------------------------------

def test_phases_resolve_to_step_ranges_with_the_run_defaults():
    cfg = load_config(None, ["distill.steps=10", "distill.beta=0.3", "data.prefix_ratios=[0.0,0.5]",
                             "distill.phases=[{steps: 4, objective: kd}, {name: late, objective: "
                             "gkd, lam: 0.5, lam_end: 1.0, prefix_ratio: 0.25}]"])
    warm, on = phases(cfg)
    assert (warm.name, warm.start, warm.end, warm.objective) == ("0:kd", 0, 4, "kd")
    assert warm.prefix_ratios == (0.0, 0.5) and warm.lr is None
    assert (on.name, on.start, on.end, on.beta, on.prefix_ratios) == ("late", 4, 10, 0.3, (0.25,))
    assert [phase_at(cfg, s).index for s in (0, 3, 4, 9, 12)] == [0, 0, 1, 1, 1]
    # the λ ramp: 0.5 at the phase's first step, 1.0 at its last, linear between
    assert [objective_at(cfg, s).lam for s in range(4, 10)] == pytest.approx(
        [0.5, 0.6, 0.7, 0.8, 0.9, 1.0], abs=1e-12)
    assert objective_at(cfg, 2).name == "kd" and rolls_out(cfg)
    assert on.describe() == "late: steps 4-9 (6), gkd (λ 0.5→1, β 0.3)"


def test_no_phases_is_one_phase_of_the_run_settings():
    cfg = load_config(None, ["distill.phases=[]", "distill.objective=gkd", "distill.lam=0.25"])
    (only,) = phases(cfg)
    assert (only.name, only.start, only.end, only.lam) == ("gkd", 0, cfg.distill.steps, 0.25)
    assert not rolls_out(load_config(None, ["distill.objective=kd"]))
    assert not rolls_out(load_config(None, ["distill.objective=gkd", "distill.lam=0"]))


def test_a_phase_learning_rate_restarts_the_schedule_inside_the_phase():
    cfg = load_config(None, ["distill.steps=10", "learner.lr=3e-3", "learner.warmup_steps=2",
                             "distill.phases=[{steps: 6}, {lr: 1.0e-3, warmup_steps: 2}]"])
    run = [3e-3 * min(1, (s + 1) / 2) * (0.1 + 0.9 * (1 - s / 10)) for s in range(6)]
    own = [1e-3 * min(1, (k + 1) / 2) * (0.1 + 0.9 * (1 - k / 4)) for k in range(4)]
    assert [learning_rate(cfg, s) for s in range(10)] == pytest.approx(run + own, rel=1e-12)


def test_objective_on_the_command_line_replaces_the_presets_phases(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("distill:\n  steps: 10\n  phases:\n    - {steps: 5, objective: kd}\n"
                      "    - {objective: gkd}\n")
    assert [p.objective for p in phases(load_config(preset))] == ["kd", "gkd"]
    plain = load_config(preset, ["distill.objective=kd"])
    assert plain.distill.phases == [] and [p.objective for p in phases(plain)] == ["kd"]
    kept = load_config(preset, ["distill.objective=kd", "distill.phases.1.lam=0.5"])
    assert [(p.objective, p.lam) for p in phases(kept)] == [("kd", 1.0), ("gkd", 0.5)]


def test_one_phase_key_over_the_built_in_schedule():
    """`distill.phases.N.KEY=V` with no preset indexes the built-in schedule (KD, then GKD)."""
    cfg = load_config(None, ["distill.steps=200", "distill.phases.0.steps=140",
                             "distill.phases.1.lam=0.5"])
    assert [(p.objective, p.steps, p.lam) for p in cfg.distill.phases] == \
        [("kd", 140, None), ("gkd", None, 0.5)]
    assert load_config(None).distill.phases[0].steps == 1800       # the default is untouched


def test_a_preset_that_sets_its_objective_trains_with_it_for_the_whole_run(tmp_path):
    """tiny.yaml (objective gkd) extends the default (KD warm start, then GKD): it runs GKD for
    every step; a preset extending it with its own phases has those."""
    assert [p.name for p in phases(load_config("default"))] == ["warm", "onpolicy"]
    assert [(p.objective, p.start, p.end) for p in phases(load_config("tiny"))] == [("gkd", 0, 3)]
    child = tmp_path / "child.yaml"
    child.write_text("extends: tiny\ndistill:\n  steps: 4\n  phases: [{steps: 1, objective: kd}, {}]\n")
    assert [(p.objective, p.end) for p in phases(load_config(child))] == [("kd", 1), ("gkd", 4)]
    grandchild = tmp_path / "grandchild.yaml"
    grandchild.write_text(f"extends: {child}\nrollout:\n  window: 8\n")
    assert len(phases(load_config(grandchild))) == 2


@pytest.mark.parametrize("overrides, message", [
    (["distill.phases=[{steps: 2, lamb: 1}]"],
     r"^unknown config key 'distill.phases\[0\].lamb'; did you mean 'distill.phases\[0\].lam'\?$"),
    (["distill.phases=[{steps: 2}, {lam: 2}]"],
     r"^distill.phases\[1\].lam=2: must be >= 0 and <= 1$"),
    (["distill.phases=[{steps: 2}, {objective: sft}]"],
     r"^distill.phases\[1\].objective='sft': expected one of 'gkd', 'varkd', 'kd', 'seqkd' or null$"),
    (["distill.phases=[{objective: kd}, {objective: gkd}]"],
     r"^distill.phases\[0\].steps is not set: only the last phase may leave out its steps"),
    (["distill.steps=10", "distill.phases=[{steps: 4}, {steps: 4}]"],
     r"^distill.phases: the phases' steps add up to 8, not distill.steps=10; set "),
    (["distill.steps=4", "distill.phases=[{steps: 4}, {}]"],
     r"^distill.phases: the phases before the last take 4 steps, leaving none"),
    (["distill.phases=[{steps: 2, objective: kd, lam_end: 1}, {}]"],
     r"^distill.phases\[0\].lam_end=1: a lambda ramp needs objective gkd"),
    (["distill.phases=kd"], r"^distill.phases='kd': expected a list of mappings with keys name, "),
    (["distill.phases=[3]"], r"^'distill.phases\[0\]' must be a mapping of keys, got 3$"),
    (["distill.phases.2.lam=0.5"], r"^distill.phases.2.lam: distill.phases holds 2 entries"),
    (["distill.phases=[]", "distill.phases.0.steps=3"],
     r"^distill.phases.0.steps: distill.phases is empty, so it has no entry 0; set the whole "
     r"list as distill.phases=\[\{\.\.\.\}, \.\.\.\]$"),
])
def test_bad_phases_are_named_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_scored_and_unscored_phases_in_one_run(tiny_overrides, tmp_path):
    """KD on top-k teacher scores, then SeqKD on teacher samples (no scores): each step has
    its phase's source and only the scored steps pay for the teacher's scoring."""
    cfg = cfg_for(tiny_overrides, "distill.phases=[{steps: 2, objective: kd}, {objective: seqkd}]",
                  "teacher.transport=topk", "teacher.topk=4")
    rows = run_reference(cfg, tmp_path, progress=False)
    assert [r["source"] for r in rows] == ["data"] * 2 + ["teacher"] * 3
    assert [r["teacher_s"] > 0 for r in rows] == [True] * 2 + [False] * 3


# --- the reference loop across a phase boundary ------------------------------------------------

@pytest.fixture(scope="module")
def phased_run(tiny_overrides, tmp_path_factory):
    return run_reference(cfg_for(tiny_overrides, WARM_THEN_GKD),
                         tmp_path_factory.mktemp("phased"), progress=False)


def test_each_step_trains_as_its_phase_says(phased_run, tiny_overrides, tmp_path):
    rows = phased_run
    assert [r["phase"] for r in rows] == ["warm", "warm", "onpolicy", "onpolicy", "onpolicy"]
    assert [r["source"] for r in rows] == ["data", "data", "student", "student", "student"]
    assert [r["ar_rounds"] for r in rows] == [0, 0] + [64 - r["prefix_len"] for r in rows[2:]]
    # the warm phase is the plain KD run's first steps (same batches, same run-level lr)
    kd = run_reference(cfg_for(tiny_overrides, "distill.objective=kd"), tmp_path, progress=False)
    assert losses(rows)[:2] == losses(kd)[:2]
    assert losses(rows)[2:] != losses(kd)[2:]


def test_resume_at_the_phase_boundary_is_exact(phased_run, tiny_overrides, tmp_path, monkeypatch):
    cfg = cfg_for(tiny_overrides, WARM_THEN_GKD, "run.checkpoint_every=2")
    first = run_reference(cfg, tmp_path, progress=False, stop_after=3)   # checkpoint at step 2
    assert losses(first) == losses(phased_run)[:3]
    loaded = []
    load = reference.load_checkpoint
    monkeypatch.setattr(reference, "load_checkpoint",
                        lambda path, *a: loaded.append(path.name) or load(path, *a))
    resumed = run_reference(cfg, tmp_path, progress=False, resume=True)
    assert loaded == ["step_000002"]
    assert [r["phase"] for r in resumed] == [r["phase"] for r in phased_run]
    assert losses(resumed) == pytest.approx(losses(phased_run), rel=0, abs=1e-7)
