"""Run config: defaults, presets, overrides of every type, and the exact error messages."""
from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from opd.config.schema import PhaseConfig, RunConfig, apply_overrides, config_from_dict, default_run_dir, load_config, validate
from opd.config.files import CONFIG_DIR, available_presets, config_hash, config_to_dict, config_to_yaml, save_config
from opd.config.loader import ConfigError


def error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


# --- defaults and presets -------------------------------------------------------------------

def test_defaults_are_the_digits_setup_and_valid():
    cfg = RunConfig()
    assert validate(cfg) == cfg
    assert load_config() == cfg
    assert (cfg.model.student, cfg.model.teacher, cfg.model.vocab_size) == ("GPT-digits-S", "GPT-digits-T", 17)
    assert (cfg.rollout.engine, cfg.rollout.window, cfg.distill.objective) == ("hbsjd", "auto", "kd")
    assert cfg.learner.betas == (0.9, 0.95) and cfg.learner.weight_decay == 0.0
    assert cfg.cluster.address is None and cfg.run.dir is None


def test_every_field_has_a_docstring():
    """Every key of every section (the schema's modules, where RunConfig finds its sections)."""
    import ast
    import inspect
    import sys

    from opd.config.loader import hints
    sections = {tp for tp in hints(RunConfig).values() if dataclasses.is_dataclass(tp)}
    sections |= {t for tp in hints(RunConfig).values() for t in typing.get_args(tp)
                 if dataclasses.is_dataclass(t)}
    sections.add(PhaseConfig)
    assert len(sections) == 11
    for cls in sections:
        node = ast.parse(inspect.getsource(sys.modules[cls.__module__])).body
        node = next(n for n in node if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{node.name}.{stmt.target.id} has no docstring"


def test_default_preset_equals_dataclass_defaults():
    assert "default" in available_presets() and "tiny" in available_presets()
    assert load_config("default") == RunConfig()


def test_tiny_preset_merges_over_defaults():
    cfg = load_config("tiny")
    assert cfg.distill.steps == 3 and cfg.data.batch_size == 4 and cfg.run.name == "tiny"
    assert cfg.cluster.include_dashboard is False
    # keys the preset leaves out keep their defaults
    assert cfg.rollout.engine == "hbsjd" and cfg.learner.lr == 3e-3 and cfg.model.grid_size == 8
    assert cfg.distill.lam == 1.0 and cfg.data.prefix_ratios == (0.0, 0.5)   # on-policy, prefixes


def test_preset_by_name_relative_path_or_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # configs/tiny.yaml must resolve to the repo's configs dir anyway
    a = load_config("tiny")
    assert load_config("configs/tiny.yaml") == a == load_config("tiny.yaml")
    assert load_config(str(CONFIG_DIR / "tiny.yaml")) == a


def test_user_preset_with_extends(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: tiny\nrollout:\n  window: 5\nlearner:\n  lr: 2e-4\n")
    cfg = load_config(str(tmp_path / "mine.yaml"))
    assert cfg.rollout.window == 5 and cfg.learner.lr == 2e-4  # "2e-4" is text to PyYAML
    assert cfg.distill.steps == 3                               # from tiny


def test_missing_preset_names_it_and_lists_presets():
    msg = error([], path="nope")
    assert "'nope' not found" in msg and "available presets: " in msg and "tiny" in msg


def test_preset_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  windw: 3\n")
    msg = error([], path=str(bad))
    assert str(bad) in msg and "unknown config key 'rollout.windw'; did you mean 'rollout.window'?" in msg
    bad.write_text("rollout: [1, 2\n")
    assert "invalid YAML" in error([], path=str(bad))


# --- overrides --------------------------------------------------------------------------------

def test_overrides_of_every_scalar_type():
    cfg = load_config("tiny", [
        "rollout.window=8",                    # int
        "learner.lr=3e-4",                     # float written without a dot
        "rollout.cfg_scale=2",                 # int into a float field
        "teacher.guided=true",                 # bool
        "rollout.engine=cached_ar",            # enum
        "run.name=1.10",                       # str field keeps the text, not the float 1.1
        "run.dir=/tmp/x",                      # str | None
        "model.student_ckpt=null",             # None
        "rollout.history_offset=None",         # None spelled the Python way
        "learner.betas=[0.8,0.9]",             # tuple from a YAML list
        "rollout.gamma=30",                    # int | "auto"
        "distill.objective_options.gate=0.25", # free-form dict entry
    ])
    assert cfg.rollout.window == 8 and cfg.learner.lr == 3e-4
    assert cfg.rollout.cfg_scale == 2.0 and isinstance(cfg.rollout.cfg_scale, float)
    assert cfg.teachers[0].guided is True and cfg.rollout.engine == "cached_ar"
    assert cfg.run.name == "1.10" and cfg.run.dir == "/tmp/x"
    assert cfg.model.student_ckpt is None and cfg.rollout.history_offset is None
    assert cfg.learner.betas == (0.8, 0.9) and cfg.rollout.gamma == 30
    assert cfg.distill.objective_options == {"gate": 0.25}
    assert load_config(None, ["rollout.gamma=auto"]).rollout.gamma == "auto"
    assert load_config(None, ["learner.betas=0.5,0.6"]).learner.betas == (0.5, 0.6)
    assert load_config(None, ["rollout.history_offset=24"]).rollout.history_offset == 24


def test_later_override_wins_and_section_mapping_override():
    cfg = load_config(None, ["rollout.window=3", "rollout.window=7", "data={batch_size: 2}"])
    assert cfg.rollout.window == 7 and cfg.data.batch_size == 2 and cfg.data.prefix_ratio == 0.0


def test_num_workers_range():
    assert load_config(None, ["rollout.num_workers=2..6"]).rollout.num_workers == (2, 6)
    assert load_config(None, ["rollout.num_workers=[1, 3]"]).rollout.num_workers == (1, 3)
    assert load_config(None, ["rollout.num_workers=4"]).rollout.num_workers == 4
    assert error(["rollout.num_workers=5..2"]) == "rollout.num_workers='5..2': min must be <= max"
    assert error(["rollout.num_workers=0..2"]) == "rollout.num_workers='0..2': must be >= 1"


def test_apply_overrides_copies():
    base = load_config("tiny")
    new = apply_overrides(base, ["distill.beta=0.1"])
    assert new.distill.beta == 0.1 and base.distill.beta == 0.5


# --- error messages ------------------------------------------------------------------------------

def test_unknown_key_suggests_the_closest():
    assert error(["rollout.windw=3"]) == "unknown config key 'rollout.windw'; did you mean 'rollout.window'?"
    assert error(["rolout.window=3"]) == "unknown config key 'rolout.window'; did you mean 'rollout.window'?"
    assert error(["window=3"]) == "unknown config key 'window'; did you mean 'rollout.window'?"
    assert error(["rollout.lr=3"]) == ("unknown config key 'rollout.lr'; "
                                       "did you mean 'learner.lr' or 'pretrain.lr'?")
    msg = error(["rollout.zzz=1"])
    assert msg.startswith("unknown config key 'rollout.zzz'; valid keys in 'rollout': engine, ")
    with pytest.raises(ConfigError) as e:
        config_from_dict({"teacher": {"top_k": 4}})
    assert str(e.value) == "unknown config key 'teacher.top_k'; did you mean 'teacher.topk'?"
    assert e.value.key == "teacher.top_k"


def test_wrong_type_names_key_value_and_type():
    assert error(["rollout.window=abc"]) == "rollout.window='abc': expected int or 'auto'"
    assert error(["rollout.window=2.5"]) == "rollout.window='2.5': expected int or 'auto'"
    assert error(["teacher.guided=maybe"]) == "teacher.guided='maybe': expected bool (true/false)"
    assert error(["learner.lr=fast"]) == "learner.lr='fast': expected float"
    assert error(["learner.betas=[0.9]"]) == "learner.betas=[0.9]: expected a list of 2 floats"
    assert error(["rollout.gamma=abc"]) == "rollout.gamma='abc': expected int or 'auto'"
    assert error(["distill.objective_options=3"]) == "distill.objective_options=3: expected a mapping"
    assert error(["rollout=3"]) == "'rollout' is a section; set one of its keys, e.g. rollout.engine=..."
    assert error(["rollout.window.x=3"]) == ("'rollout.window' is a value, not a section; "
                                             "set rollout.window=VALUE")
    assert error(["rollout.window"]).startswith("override 'rollout.window' must look like")


def test_out_of_range_names_key_value_and_range():
    assert error(["rollout.window=0"]) == "rollout.window=0: must be >= 1"
    assert error(["data.prefix_ratio=1.5"]) == "data.prefix_ratio=1.5: must be >= 0 and < 1"
    assert error(["data.prefix_ratio=1"]) == "data.prefix_ratio=1: must be >= 0 and < 1"
    assert error(["rollout.top_p=0"]) == "rollout.top_p=0: must be > 0 and <= 1"
    assert error(["learner.zero_stage=4"]) == "learner.zero_stage=4: must be >= 0 and <= 3"
    assert error(["learner.betas=[0.9,1.5]"]) == "learner.betas=[0.9, 1.5]: must be >= 0 and < 1"
    assert error(["rollout.gamma=-1"]) == "rollout.gamma=-1: must be >= 0"


def test_enum_names_key_value_and_choices():
    assert error(["rollout.engine=foo"]) == ("rollout.engine='foo': must be one of 'hbsjd', "
                                             "'cached_ar', 'sjd_sync', 'sjd_independent'")
    assert error(["distill.objective=kl"]) == ("distill.objective='kl': must be one of 'gkd', "
                                               "'varkd', 'kd', 'seqkd'")
    assert error(["eval.engine=x"]) == ("eval.engine='x': expected one of 'hbsjd', 'cached_ar', "
                                        "'sjd_sync', 'sjd_independent' or null")


def test_cross_field_checks():
    assert error(["teacher.transport=topk"]) == ("teacher.topk=0: teacher.transport='topk' needs "
                                                 "1 <= teacher.topk <= model.vocab_size (17)")
    assert load_config(None, ["teacher.transport=topk", "teacher.topk=8"]).teachers[0].topk == 8
    assert error(["rollout.top_k=18"]).startswith("rollout.top_k=18: must be <= model.vocab_size (17)")
    assert load_config(None, ["rollout.top_k=18", "model.vocab_size=16384"]).rollout.top_k == 18
    assert error(["rollout.history_offset=64"]) == ("rollout.history_offset=64: must be < the "
                                                    "sequence length model.grid_size ** 2 (64)")
    assert error(["rollout.candidates=4", "rollout.compile=true"]
                 ).startswith("rollout.candidates=4: option candidates cannot be combined with "
                              "compile")
    assert error(["rollout.candidates=4", "rollout.engine=sjd_sync"]
                 ).startswith("rollout.candidates=4: only the hbsjd and sjd_independent")
    assert error(["rollout.candidates=-1"]) == "rollout.candidates=-1: must be >= 0"


def test_candidates_reach_the_engine():
    from opd.distill.steps import build_engine
    cfg = load_config(None, ["rollout.candidates=4", "rollout.decoding=greedy"])
    assert build_engine(cfg).options["candidates"] == 4
    sampled = build_engine(load_config(None, ["rollout.candidates=2"]))   # the default: sample
    assert sampled.options["candidates"] == 2 and sampled.options["decoding"] == "sample"
    assert build_engine(cfg, "sjd_independent").options["candidates"] == 4
    assert "candidates" not in build_engine(cfg, "cached_ar").options
    assert build_engine(load_config(None, [])).options["candidates"] == 0


def test_validate_catches_bad_values_built_in_code():
    cfg = RunConfig()
    cfg.rollout.window = 0
    with pytest.raises(ConfigError, match=r"^rollout.window=0: must be >= 1$"):
        validate(cfg)


# --- serialization -----------------------------------------------------------------------------

def test_yaml_round_trip_and_save(tmp_path):
    cfg = load_config("tiny", ["rollout.num_workers=2..3", "learner.betas=[0.8,0.9]",
                               "run.name=1.10", "distill.objective_options.gate=0.5"])
    text = config_to_yaml(cfg)
    assert "betas: [0.8, 0.9]" in text
    assert config_from_dict(yaml.safe_load(text)) == cfg
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(str(path)) == cfg


def test_the_teacher_section_is_the_list_of_its_one_entry(tmp_path):
    """`teacher:` (a section, a preset's, or `teacher.KEY=VALUE`) is `teachers: [{name:
    default, ...}]`; an earlier version's config.yaml, which saved `teacher:` beside an empty
    `teachers:`, loads to the same run."""
    cfg = load_config("llamagen_b_gkd", ["teacher.num_workers=3"])
    (t,) = cfg.teachers
    assert (t.name, t.num_workers, t.transport, t.topk, t.num_gpus) == ("default", 3, "topk", 256, 1.0)
    assert not hasattr(cfg, "teacher")
    old = config_to_dict(cfg)
    section = old.pop("teachers")[0]
    old["teacher"], old["teachers"] = {**section, "name": ""}, []     # as 75420b1 saved it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert load_config(str(tmp_path / "config.yaml")) == cfg == config_from_dict(old)
    two = load_config("digits_two_teachers")                 # beside teachers:, teacher: goes
    assert [t.name for t in two.teachers] == ["low", "high"]
    with pytest.raises(ConfigError) as e:
        apply_overrides(two, ["teacher.num_workers=2"])
    assert str(e.value) == ("teacher.num_workers: this run has 2 teachers (teachers:); set "
                            "teachers.N.num_workers=VALUE on teacher N")


def test_config_hash_is_stable_and_sensitive():
    a = load_config("tiny")
    assert config_hash(a) == config_hash(load_config("tiny")) == config_hash(config_to_dict(a))
    assert len(config_hash(a)) == 12 and int(config_hash(a), 16) >= 0
    assert config_hash(a.pretrain) != config_hash(apply_overrides(a, ["pretrain.seed=1"]).pretrain)
    assert config_hash({"a": 1, "b": (1, 2)}) == config_hash({"b": [1, 2], "a": 1})


def test_default_run_dir():
    cfg = load_config(None, ["run.name=x"])
    assert str(default_run_dir(cfg, now=0.0)).startswith("runs/x-19")
    assert str(default_run_dir(apply_overrides(cfg, ["run.dir=/r"]))) == "/r"


def test_config_hash_values_are_pinned():
    """Cache keys (pretrained models, runs) hash the config: these values were computed on the
    hand-written loader, before validation moved onto pydantic, and must not change.  A new key
    changes the whole-config values (recorded in checkpoints' state.json only; rollout.candidates
    moved them from 4f0befd26218 / c775bdc45f53 / cbc1e17debe4, distill.phases from 54165f582cc2 /
    8ac49b394f92 / f21410ed6e7b), never a cache key's; so does a new default (the pretraining
    defaults and the default schedule moved 77cde6e47966 / 0db64339dabd; distill.pieces, run.loggers and the
    window's int | "auto" type moved 771512ec98a3 / f9c6facd31ff / c18f4e910c3e; the default
    window auto moved 50a03525f77e / 50804f9eaa52; eval.num_samples 1,000 every 200 steps moved
    cf125a7d81fb / 9846735e5aa3; `teachers` and the teacher sections' name, model, ckpt,
    classes and weight moved a35a6b5a83b1 / 3e0639e6adcc / 99edee1ca044; rollout.compare_every,
    distill.reuse, reuse_buffer, reuse_fresh
    and the `teacher:` section read as `teachers: [{name: default, ...}]` moved e2e9b9f0ed6e /
    8939349c977c / fb43b848f976; rollout.compare_every 10 by default moved 2c6dd197f869 /
    02d777ec0dbf / a2b22c3d2f09, then distill.cache_data_scores 42640019f946 / 7ceb120d5165 /
    a7e52e29f6db, then rollout.span 365fb5e30f8a / c9f626166b1f / b0a8ceb6f7e4, then the default schedule of
    2,400 steps (KD 1,800, on-policy 600) and eval.every 600 d7db4d73a90a / c4f48e669e89)."""
    tiny = load_config("tiny")
    assert config_hash(tiny) == "b6f692a1cb10"
    assert config_hash(RunConfig()) == "dd6cad609ce5"
    assert config_hash(tiny.pretrain) == "f5831f937353"
    assert config_hash(load_config(None, ["rollout.num_workers=2..3", "learner.betas=[0.8,0.9]",
                                          "distill.objective_options.gate=0.5"])) == "9351efa1daa2"


# --- the pydantic-based loader (opd/config/loader.py) -----------------------------------------

def test_values_no_field_type_takes():
    import datetime
    with pytest.raises(ConfigError, match=r"^learner.lr=nan: expected float$"):
        config_from_dict({"learner": {"lr": float("nan")}})
    assert config_from_dict({"learner": {"lr": float("inf")}}).learner.lr == float("inf")
    day = datetime.date(2024, 1, 1)
    with pytest.raises(ConfigError, match=r"^run.name=datetime.date\(2024, 1, 1\): expected str$"):
        config_from_dict({"run": {"name": day}})
    with pytest.raises(ConfigError, match="^distill.objective_options=datetime.date.*a mapping$"):
        config_from_dict({"distill": {"objective_options": day}})
    assert load_config(None, ["run.name=2024-01-01"]).run.name == "2024-01-01"
    opts = {1: (1, 2), "when": day}                  # free-form options are kept as written
    assert config_from_dict({"distill": {"objective_options": opts}}).distill.objective_options == opts


def test_sections_and_strict_types():
    assert config_from_dict({"rollout": None}) == RunConfig()
    with pytest.raises(ConfigError, match=r"^'rollout' must be a mapping of keys, got \[1\]$"):
        config_from_dict({"rollout": [1]})
    with pytest.raises(ConfigError, match=r"^'the config' must be a mapping of keys, got 'x'$"):
        config_from_dict("x")
    for tree, msg in [({"model": {"vocab_size": True}}, "model.vocab_size=True: expected int"),
                      ({"rollout": {"window": "3"}}, "rollout.window='3': expected int or 'auto'"),
                      ({"cluster": {"num_cpus": 2.0}}, "cluster.num_cpus=2.0: expected int or null"),
                      ({"teacher": {"guided": 1}}, "teacher.guided=1: expected bool (true/false)")]:
        with pytest.raises(ConfigError) as e:
            config_from_dict(tree)
        assert str(e.value) == msg
    assert config_from_dict({"run": {"name": 5, "dir": "None"}}).run.name == "5"


def test_first_problem_in_file_order_is_reported():
    def first(tree):
        with pytest.raises(ConfigError) as e:
            config_from_dict(tree)
        return str(e.value)
    assert first({"rollout": {"window": 0, "engine": "x"}}) == "rollout.window=0: must be >= 1"
    assert first({"rollout": {"engine": "x", "window": 0}}).startswith("rollout.engine='x'")
    assert first({"rollout": {"windw": 1, "window": "a"}}).startswith("unknown config key")
    assert first({"rollout": {"window": "a", "windw": 1}}) == "rollout.window='a': expected int or 'auto'"


def test_bench_preset_schemas_have_docstrings_and_use_the_loader():
    """The bench presets are schemas of the same loader: every field has a docstring, unknown
    keys and wrong types are one line naming the key."""
    import ast
    import inspect

    from launch.bench import paper, rollout
    for mod, name in ((rollout, "RolloutBench"), (paper, "PaperBench")):
        node = next(n for n in ast.parse(inspect.getsource(mod)).body
                    if isinstance(n, ast.ClassDef) and n.name == name)
        body = [s for s in node.body if not isinstance(s, ast.Expr)]
        assert body and all(isinstance(s, ast.AnnAssign) for s in body)
        for i, stmt in enumerate(node.body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = node.body[i + 1] if i + 1 < len(node.body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{name}.{stmt.target.id} has no docstring"
    with pytest.raises(ConfigError) as e:
        rollout.load_bench("digits", {"windws": [2]})
    assert str(e.value) == "unknown bench preset key 'windws'; did you mean 'windows'?"
    with pytest.raises(ConfigError) as e:
        paper.load_paper_bench("cpu_tiny", {"W": "8"})
    assert str(e.value) == "W='8': expected int"


def test_bench_preset_extends_another(tmp_path):
    from launch.bench.paper import load_paper_bench
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: cpu_tiny\nbatch: 2\n")
    b = load_paper_bench(mine)
    assert (b.batch, b.model, b.W) == (2, "GPT-tiny", 4)
    mine.write_text("extends: cpu_tiny\nbatch: 0\n")
    with pytest.raises(ConfigError, match=rf"^{mine}: batch=0: must be >= 1$"):
        load_paper_bench(mine)


def test_rules_between_keys_wait_for_the_overrides(tmp_path):
    """A preset is checked key by key before its overrides, the rules between keys after them:
    an override may complete what a rule relates."""
    (tmp_path / "topk.yaml").write_text("teacher:\n  transport: topk\n")
    assert load_config(str(tmp_path / "topk.yaml"), ["teacher.topk=8"]).teachers[0].topk == 8
    assert error([], path=str(tmp_path / "topk.yaml")) == (
        "teacher.topk=0: teacher.transport='topk' needs 1 <= teacher.topk <= model.vocab_size (17)")
