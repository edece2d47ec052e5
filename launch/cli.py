"""The `opd` command: subcommands from launch/commands/, one-line errors for user mistakes.

    opd prepare digits
    opd train --config tiny rollout.window=8
    opd train --config tiny --print-config
    opd export --ckpt runs/tiny-… --out student.pt
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType

USER_ERRORS = [
    ("opd.config.schema", "ConfigError"),
    ("opd.data", "DataError"),
    ("opd.models.safe_load", "CheckpointError"),
    ("opd.run.rundir", "RunDirError"),
]
"""(module, class) of errors a user causes: shown as `opd: error: <message>`, exit 2."""


def build_parser(commands: list[ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opd", description="On-policy distillation of visual AR image generators on Ray, "
                                "with HB-SJD speculative Jacobi rollouts.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in commands:
        module.add_parser(sub).set_defaults(command_module=module)
    return parser


def main(argv: list[str] | None = None, commands: list[ModuleType] | None = None) -> int:
    """Run `opd argv...`; returns the exit status (2 for a user error)."""
    from launch.commands import load_commands

    parser = build_parser(load_commands() if commands is None else commands)
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "takes_config", False):
        # overrides may follow options (`--config tiny a=1 --print-config b=2`)
        args.overrides += [e for e in extra if "=" in e and not e.startswith("-")]
        extra = [e for e in extra if e not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "takes_config", False):
            from opd.config.schema import load_config
            from opd.config.files import config_to_yaml
            # `opd train --resume RUN`: the run's own config.yaml is the base (the command loads
            # it); the default preset with the overrides may not even be valid on its own
            resuming = getattr(args, "resume", None) is not None
            args.cfg = None if resuming else load_config(args.config, args.overrides)
            if args.print_config and not resuming:
                sys.stdout.write(config_to_yaml(args.cfg))
                return 0
        return args.command_module.run(args) or 0
    except KeyboardInterrupt:
        print("opd: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_user_error(e):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"opd: error: {message}", file=sys.stderr)
        return 2


def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError)):
        return True
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)  # raised from it => already imported
        if cls is not None and isinstance(e, cls):
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
