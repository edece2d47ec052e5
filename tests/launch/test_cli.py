"""The `opd` command: help, command registry, config handling and one-line user errors."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from launch import cli
from launch.commands import COMMANDS, add_config_args, load_commands
from opd.config.schema import config_from_dict, load_config
from opd.config.loader import ConfigError

REPO = Path(__file__).resolve().parents[2]


def echo_command() -> types.ModuleType:
    """A config-taking command (what `opd train` will be) that records the config it got."""
    mod = types.ModuleType("echo")
    mod.seen = []

    def add_parser(sub):
        p = sub.add_parser("echo", help="test command")
        add_config_args(p)
        return p

    def run(args):
        mod.seen.append(args.cfg)
        if args.cfg.run.name == "explode":
            raise ConfigError("deep problem\nsecond line")
        if args.cfg.run.name == "nofile":
            open(args.cfg.run.dir)  # FileNotFoundError naming the path
        if args.cfg.run.name == "bug":
            raise RuntimeError("a real bug")
        return 0

    mod.add_parser, mod.run = add_parser, run
    return mod


def test_help_lists_commands_and_does_not_import_torch():
    code = ("import sys; from launch.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'opd --help imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: opd") and "prepare" in out.stdout


def test_every_registered_command_has_help(capsys):
    assert "prepare" in COMMANDS
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: opd {name}")
    for sub in ("digits", "llamagen-codes"):
        with pytest.raises(SystemExit) as e:
            cli.main(["prepare", sub, "--help"])
        assert e.value.code == 0
        assert "--out" in capsys.readouterr().out


def test_prepare_dispatches_to_opd_data(monkeypatch, capsys, tmp_path):
    calls = []
    fake = types.ModuleType("opd.data")
    fake.prepare_digits = lambda out, grid: calls.append(("digits", out, grid)) or {"train": Path(out) / "t"}
    fake.prepare_llamagen_codes = lambda c, l, o, **kw: calls.append(("codes", c, l, o, kw)) or Path(o)
    monkeypatch.setitem(sys.modules, "opd.data", fake)
    assert cli.main(["prepare", "digits", "--out", str(tmp_path)]) == 0
    assert cli.main(["prepare", "digits"]) == 0
    assert cli.main(["prepare", "digits", "--grid", "16"]) == 0
    assert cli.main(["prepare", "llamagen-codes", "--codes", "c", "--labels", "l", "--out", "o.parquet",
                     "--vocab-size", "8"]) == 0
    assert calls == [("digits", str(tmp_path), 8), ("digits", "data/digits8", 8),
                     ("digits", "data/digits16", 16),
                     ("codes", "c", "l", "o.parquet", {"vocab_size": 8, "num_classes": 1000})]
    assert f"wrote {tmp_path / 't'}" in capsys.readouterr().out


def test_prepare_digits_writes_files(tmp_path, capsys):
    assert cli.main(["prepare", "digits", "--out", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "train.parquet").is_file()
    assert "wrote" in capsys.readouterr().out


def test_data_error_is_one_line_exit_2(tmp_path, capsys):
    rc = cli.main(["prepare", "llamagen-codes", "--codes", str(tmp_path / "missing"),
                   "--labels", str(tmp_path), "--out", str(tmp_path / "o.parquet")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("opd: error: ") and err.count("\n") == 1
    assert "missing" in err and "Traceback" not in err


def test_config_command_gets_validated_config():
    echo = echo_command()
    assert cli.main(["echo", "--config", "tiny", "rollout.window=8"], commands=[echo]) == 0
    assert echo.seen[-1] == load_config("tiny", ["rollout.window=8"])
    # overrides may come before and after options
    assert cli.main(["echo", "rollout.window=5", "--config", "tiny", "distill.steps=9"],
                    commands=[echo]) == 0
    assert (echo.seen[-1].rollout.window, echo.seen[-1].distill.steps, echo.seen[-1].run.name) == (5, 9, "tiny")


@pytest.mark.parametrize("argv, message", [
    (["rollout.windw=3"], "opd: error: unknown config key 'rollout.windw'; did you mean 'rollout.window'?"),
    (["rollout.window=abc"], "opd: error: rollout.window='abc': expected int or 'auto'"),
    (["rollout.window=0"], "opd: error: rollout.window=0: must be >= 1"),
    (["--config", "nope"], "opd: error: config 'nope' not found"),
    (["run.name=explode"], "opd: error: deep problem second line"),
    (["run.name=nofile", "run.dir=/no/such/file"], "opd: error: [Errno 2] No such file or directory: '/no/such/file'"),
])
def test_config_errors_are_one_line_exit_2(argv, message, capsys):
    echo = echo_command()
    assert cli.main(["echo", *argv], commands=[echo]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1
    assert captured.out == "" and "Traceback" not in captured.err
    if not argv[0].startswith("run.name="):
        assert echo.seen == []  # an invalid config never reaches run()


def test_bugs_are_not_swallowed():
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["echo", "run.name=bug"], commands=[echo_command()])


def test_unknown_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["echo", "--nope"], commands=[echo_command()])
    assert e.value.code == 2 and "unrecognized arguments: --nope" in capsys.readouterr().err


def test_print_config_reloads_to_the_same_config(capsys):
    echo = echo_command()
    argv = ["echo", "--config", "tiny", "rollout.num_workers=1..3", "learner.betas=[0.8,0.9]",
            "--print-config"]
    assert cli.main(argv, commands=[echo]) == 0
    assert echo.seen == []  # printed, not run
    printed = capsys.readouterr().out
    assert config_from_dict(yaml.safe_load(printed)) == load_config(
        "tiny", ["rollout.num_workers=1..3", "learner.betas=[0.8,0.9]"])


def test_console_script_entry_point():
    """`python -m launch.cli` (what the `opd` script runs) gives argparse's exit 2 on a missing dataset."""
    out = subprocess.run([sys.executable, "-m", "launch.cli", "prepare"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "opd prepare: error:" in out.stderr
    assert [m.__name__ for m in load_commands()] == [f"launch.commands.{n}" for n in COMMANDS]
