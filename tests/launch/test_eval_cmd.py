"""`opd eval` argument handling (no models run here; tests/opd/test_eval_run.py runs them)."""
from __future__ import annotations

import pytest

from launch import cli
from launch.commands import COMMANDS, load_commands, eval as eval_cmd


def parse(argv):
    parser = cli.build_parser(load_commands(["eval"]))
    args, extra = parser.parse_known_args(argv)
    return args, extra


def test_eval_is_a_command():
    assert "eval" in COMMANDS


def test_flags_are_config_overrides():
    args, _ = parse(["eval", "--ckpt", "runs/x", "--engine", "cached_ar", "--num-samples", "40",
                     "--decoding", "greedy", "--reference", "ref.pt"])
    assert eval_cmd.flag_overrides(args) == ["eval.engine=cached_ar", "eval.decoding=greedy",
                                             "eval.num_samples=40", "eval.reference=ref.pt"]
    args, _ = parse(["eval", "--ckpt", "runs/x"])
    assert eval_cmd.flag_overrides(args) == []


def test_ckpt_compare_and_save_reference_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse(["eval", "--ckpt", "a", "--compare", "b"])
    with pytest.raises(SystemExit):
        parse(["eval"])
    with pytest.raises(SystemExit):
        parse(["eval", "--ckpt", "a", "--engine", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_compare_takes_several_runs_then_overrides():
    args, _ = parse(["eval", "--compare", "runs/a", "runs/b", "--out", "t"])
    assert args.compare == ["runs/a", "runs/b"] and args.out == "t"
    args, _ = parse(["eval", "--compare", "runs/a", "runs/b", "eval.seed=3"])
    assert eval_cmd.split_runs(args.compare) == (["runs/a", "runs/b"], ["eval.seed=3"])


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert cli.main(["eval", "--ckpt", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opd: error: --ckpt") and "nope" in err and "run directory" in err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    assert cli.main(["eval", "--ckpt", str(tmp_path / "run")]) == 2
    assert (f"run directory {tmp_path / 'run'} holds no complete checkpoint "
            f"(checkpoints/step_N/student.pt) yet" in capsys.readouterr().err)
