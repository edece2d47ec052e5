"""`opd` subcommands: one module per command, registered by name in COMMANDS.

A command module exposes

    add_parser(subparsers) -> argparse.ArgumentParser   # registers `opd <name>` and its options
    run(args) -> int | None                              # does the work; None means exit 0

A command that takes a run config calls `add_config_args(parser)` in add_parser; `opd` then
loads and validates the config before `run` is called (`args.cfg: RunConfig`), and handles
`--print-config`. Commands stay thin: parse, build, call into the packages.
"""
from __future__ import annotations

import argparse
import importlib
from types import ModuleType

COMMANDS = [
    "prepare",
    "pretrain",
    "train",
    "calibrate", "bench",
    "eval", "export",
]
"""Command modules in launch/commands/, in `opd --help` order. Adding a command is one line."""


def load_commands(names: list[str] | None = None) -> list[ModuleType]:
    """The command modules (imported lazily: a module must not import torch at top level)."""
    return [importlib.import_module(f"{__name__}.{n}") for n in (names or COMMANDS)]


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """`--config PRESET`, positional `key=value` overrides and `--print-config`."""
    parser.add_argument("--config", metavar="PRESET", default=None,
                        help="YAML preset: a name in configs/ (e.g. tiny) or a path "
                             "(default: the embedded digits setup)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, values parsed as YAML, "
                             "e.g. rollout.window=8 learner.betas=[0.9,0.99]")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.set_defaults(takes_config=True)
