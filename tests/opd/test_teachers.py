"""Several teachers (opd/distill/teachers.py): routing by class and mixing by weight, checked
against the one-teacher run and against direct computations, and the config's refusals."""
import math

import pytest
import torch

from opd.config.loader import ConfigError
from opd.config.schema import load_config
from opd.distill.batch import TrajectoryBatch
from opd.distill.teachers import (MIX, ROUTE, Share, cut_share, merge_shares, mixture,
                                  run_teachers, share_from_numpy, share_to_numpy, take_index)
from opd.run.reference import run_reference

ROUTED = "teachers=[{name: low, classes: [0,1,2,3,4]}, {name: high, classes: [5,6,7,8,9]}]"
ALL = "teachers=[{name: all, classes: [0,1,2,3,4,5,6,7,8,9]}]"
MIXED = "teachers=[{name: a, weight: 1.0}, {name: b, weight: 3.0}]"
TWINS = "teachers=[{name: a, weight: 1.0}, {name: b, weight: 1.0}]"


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "distill.steps=2", "eval.track=false",
                                "data.batch_size=8", "distill.pieces=2", *extra])


def test_the_rule_of_each_form(tiny_overrides):
    one = run_teachers(cfg_for(tiny_overrides))           # a list of one: one share, every row
    assert (one.names, one.rule, one.pool(0)) == (["default"], MIX, "teacher/default")
    assert one.share_rows(0, torch.tensor([7, 0])) is None and one.scorers(torch.tensor([7])) == [0]
    assert run_teachers(cfg_for(tiny_overrides, ROUTED)).rule == ROUTE
    assert run_teachers(cfg_for(tiny_overrides, MIXED)).rule == MIX
    t = run_teachers(cfg_for(tiny_overrides, ROUTED))
    labels = torch.tensor([7, 0, 5, 4, 9])
    assert t.owners(labels).tolist() == [1, 0, 1, 0, 1]
    assert t.share_rows(0, labels).tolist() == [1, 3]
    assert t.scorers(torch.tensor([6, 8])) == [1]
    assert run_teachers(cfg_for(tiny_overrides, MIXED)).weights() == [0.25, 0.75]


@pytest.mark.parametrize("items, words", [
    ("teachers=[{name: a, classes: [0,1,2,3,4]}, {name: b, classes: [4,5,6,7,8,9]}]",
     "class 4 is owned by 'a' too"),
    ("teachers=[{name: a, classes: [0,1,2,3]}, {name: b, classes: [5,6,7,8,9]}]",
     "classes [4] are owned by no teacher"),
    ("teachers=[{name: a, weight: 0.0}, {name: b, weight: 0.0}]", "the weights sum to 0"),
    ("teachers=[{name: a, weight: -1.0}, {name: b, weight: 1.0}]", "teachers[0].weight"),
    ("teachers=[{name: a, weight: 1.0}, {name: b, classes: [1]}]", "either the classes"),
    ("teachers=[{name: a, weight: 1.0}, {name: a, weight: 1.0}]", "a name of its own"),
    ("teachers=[{name: a, classes: [0,1,2,3,4,5,6,7,8,9,10]}]", "class 10 is not a label"),
    ("teachers=[{name: a, weight: 1.0, transport: topk, topk: 4}, "
     "{name: b, weight: 1.0, transport: topk, topk: 4}]", "exact only over the full vocabulary"),
    ("teachers=[{name: a, classes: [0,1,2,3,4], transport: topk, topk: 4}, "
     "{name: b, classes: [5,6,7,8,9]}]", "one kind of target"),
    ("teacher.classes=[1,2]", "classes [0, 3, 4, 5, 6, 7, 8, 9] are owned by no teacher"),
])
def test_bad_teachers_are_named_in_one_line(tiny_overrides, items, words):
    with pytest.raises(ConfigError) as e:
        cfg_for(tiny_overrides, items)
    assert words in str(e.value) and "\n" not in str(e.value)


def batch(rows=5, seed=0, V=17, T=6, P=2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (rows, T), generator=g)
    lp = torch.log_softmax(torch.randn(rows, T - P, V, generator=g), -1)
    return TrajectoryBatch(3, torch.arange(rows) % 10, P, tokens, teacher_logprobs=lp,
                           behaviour_logprobs=torch.randn(rows, T - P, generator=g))


def test_routed_shares_merge_back_in_row_order_and_cut_per_rank(tiny_overrides):
    t = run_teachers(cfg_for(tiny_overrides, ROUTED))
    whole = batch(rows=7)
    shares = [Share(i, r, take_index(whole, r)) for i in (0, 1)
              if (r := t.share_rows(i, torch.tensor([7, 0, 5, 4, 9, 1, 6])))is not None]
    merged = merge_shares(t, shares[::-1])
    assert torch.equal(merged.tokens, whole.tokens)
    assert torch.equal(merged.teacher_logprobs, whole.teacher_logprobs)
    assert torch.equal(merged.behaviour_logprobs, whole.behaviour_logprobs)
    for a, b in ((0, 3), (3, 7)):                       # a learner rank's cut, over the wire
        cut = [share_from_numpy(share_to_numpy(cut_share(s, a, b))) for s in shares]
        assert torch.equal(merge_shares(t, cut).tokens, whole.tokens[a:b])


def test_mixing_is_the_normalised_weighted_mixture_in_float64(tiny_overrides):
    t = run_teachers(cfg_for(tiny_overrides, MIXED))
    a, b = batch(seed=1), batch(seed=2)
    merged = merge_shares(t, [Share(1, None, b), Share(0, None, a)])
    pa, pb = a.teacher_logprobs.double().exp(), b.teacher_logprobs.double().exp()
    want = torch.log(0.25 * pa + 0.75 * pb)
    torch.testing.assert_close(merged.teacher_logprobs.double(), want, rtol=0, atol=1e-6)
    assert torch.allclose(merged.teacher_logprobs.exp().sum(-1), torch.ones(()), atol=1e-5)
    same = mixture([a.teacher_logprobs] * 2, [0.5, 0.5])
    assert torch.equal(same, a.teacher_logprobs)        # two equal teachers: the teacher itself


def test_one_teacher_owning_every_class_is_the_one_teacher_run(tiny_overrides, tmp_path):
    one = run_reference(cfg_for(tiny_overrides), tmp_path / "one", progress=False)
    alone = run_reference(cfg_for(tiny_overrides, ALL), tmp_path / "all", progress=False)
    assert [r["loss"] for r in alone] == [r["loss"] for r in one]
    assert [r["grad_norm"] for r in alone] == [r["grad_norm"] for r in one]


def test_two_identical_teachers_mixed_are_the_one_teacher_run(tiny_overrides, tmp_path):
    one = run_reference(cfg_for(tiny_overrides), tmp_path / "one", progress=False)
    twins = run_reference(cfg_for(tiny_overrides, TWINS), tmp_path / "twins", progress=False)
    assert [r["loss"] for r in twins] == [r["loss"] for r in one]
    assert all(r["teacher_rows/a"] == r["teacher_rows/b"] == 8 for r in twins)
    assert all(r["teacher_kl/a"] == r["teacher_kl/b"] for r in twins)


def test_the_ensemble_is_each_rows_owner_and_samples_as_the_owner(tiny_overrides):
    """The routed `TeacherEnsemble` (what evaluation measures a run of several teachers
    against) gives each row its owner's logits, bit for bit; with the keyed sampler its samples of class c
    are the owner's own samples of class c, token for token (Cached AR and HB-SJD)."""
    from opd.distill.ensemble import load_teacher
    from opd.eval.sample import sample_tokens
    from opd.models.factory import load_role_model
    cfg = cfg_for(tiny_overrides, ROUTED, "rollout.decoding=sample")
    ensemble = load_teacher(cfg, progress=False)
    owners = [load_role_model(cfg, "teacher", teacher=t, progress=False) for t in cfg.teachers]
    labels = torch.tensor([7, 0, 5, 4])
    tokens = torch.randint(0, 17, (4, 63))
    got = ensemble(labels, tokens)
    for i, model in enumerate(owners):
        rows = (labels >= 5) == bool(i)
        assert torch.equal(got[rows], model(labels, tokens)[rows])
    for engine in ("cached_ar", "hbsjd"):
        mixed = sample_tokens(ensemble, cfg, 20, engine=engine).tokens
        for i, model in enumerate(owners):
            own = sample_tokens(model, cfg, 20, engine=engine).tokens
            rows = [k for k in range(20) if (k % 10 >= 5) == bool(i)]
            assert torch.equal(mixed[rows], own[rows]), (engine, i)


@pytest.mark.parametrize("rule", [(), (ALL,)], ids=["mixed", "routed"])
def test_one_teacher_is_an_ensemble_of_one_bit_for_bit(tiny_overrides, rule):
    """What evaluation measures a one-teacher run against is the `TeacherEnsemble` of its one
    teacher, and that is the teacher: logits (a full forward, a prefill and a cached forward,
    the null class of CFG among the rows) and sampled tokens equal its own, bit for bit."""
    from opd.distill.ensemble import TeacherEnsemble, load_teacher
    from opd.eval.sample import sample_tokens
    cfg = cfg_for(tiny_overrides, *rule, "rollout.decoding=sample")
    ensemble = load_teacher(cfg, progress=False)
    (model,) = ensemble.members
    assert isinstance(ensemble, TeacherEnsemble)
    labels = torch.tensor([7, 0, 10, 4])                         # 10: the null class
    tokens = torch.randint(0, 17, (4, 63))
    assert torch.equal(ensemble(labels, tokens), model(labels, tokens))
    outs = []
    for m in (ensemble, model):
        m.setup_cache(4, 64)
        rows = torch.tensor([3, 1, 0, 2])
        first = m.prefill(labels, tokens[:, :5], rows)
        pos = torch.arange(6, 9).expand(4, 3)
        outs.append((first, m.forward_cached(tokens[:, 5:8], pos, rows)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    for engine in ("cached_ar", "hbsjd"):
        assert torch.equal(sample_tokens(ensemble, cfg, 20, engine=engine).tokens,
                           sample_tokens(model, cfg, 20, engine=engine).tokens)


def test_a_routed_run_scores_each_row_once_and_evaluates_against_the_ensemble(tiny_overrides,
                                                                             tmp_path):
    import pyarrow.parquet as pq
    cfg = cfg_for(tiny_overrides, ROUTED, "eval.track=true")
    steps = run_reference(cfg, tmp_path, progress=False)
    for r in steps:
        assert r["teacher_rows/low"] + r["teacher_rows/high"] == 8
        assert all(math.isfinite(r[f"teacher_kl/{n}"]) or r[f"teacher_rows/{n}"] == 0
                   for n in ("low", "high"))
    rows = pq.read_table(tmp_path / "quality.parquet").to_pylist()
    assert [(r["role"], r["step"]) for r in rows] == [("teacher", 0), ("student", 0),
                                                      ("student", 2)]
    assert all(math.isfinite(r["kl_data"]) for r in rows if r["role"] == "student")


def test_a_teachers_missing_or_mismatched_checkpoint_is_named(tiny_overrides, tmp_path):
    from opd.models import CheckpointError, create_model
    from opd.models.factory import load_role_model
    from opd.run.preflight import missing_inputs
    cfg = cfg_for(tiny_overrides, f"teachers=[{{name: a, weight: 1.0, ckpt: {tmp_path}/no.pt}}, "
                                  "{name: b, weight: 1.0}]")
    (problem,) = missing_inputs(cfg)
    assert problem.startswith(f"teachers[0].ckpt={tmp_path}/no.pt does not exist")
    wide = create_model("GPT-digits-T", vocab_size=20, num_classes=10, grid_size=8)
    torch.save({"model": wide.state_dict()}, tmp_path / "wide.pt")
    cfg = cfg_for(tiny_overrides, f"teachers=[{{name: a, weight: 1.0, ckpt: {tmp_path}/wide.pt}}, "
                                  "{name: b, weight: 1.0}]")
    with pytest.raises(CheckpointError, match=r"teacher 'a' \(teachers\[\]\.ckpt\).*vocab_size=17"):
        load_role_model(cfg, "teacher", teacher=cfg.teachers[0], progress=False)


def test_eval_measures_the_student_against_the_runs_teachers(tiny_overrides, monkeypatch):
    """`opd eval`'s held-out quality (opd/eval/run.py `heldout_quality`) compares the student
    with the teachers the run distilled towards: the routed ensemble of `teachers`, not the
    `model.teacher` preset."""
    import opd.eval.quality
    from opd.distill.ensemble import TeacherEnsemble
    from opd.eval.run import heldout_quality
    from opd.models.factory import load_role_model
    cfg = cfg_for(tiny_overrides, ROUTED)
    seen = []
    monkeypatch.setattr(opd.eval.quality, "quality_report",
                        lambda student, teacher, *a, **k: seen.append(teacher) or {})
    heldout_quality(load_role_model(cfg, "student", progress=False), cfg)
    (teacher,) = seen
    assert isinstance(teacher, TeacherEnsemble) and len(teacher.members) == 2
