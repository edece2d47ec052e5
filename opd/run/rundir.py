"""Run directories: created fresh, never overwritten without asking, resumable, held by one run.

A run directory holds `config.yaml` (the resolved config), `metrics.parquet`, `checkpoints/`,
sample grids and plots, and while a run uses it `lock`: "<pid> <host>" of that `opd train`.

- A new run needs an empty directory, or one that holds nothing but `config.yaml` (and a lock
  of a run that is gone): what a run leaves when it stops before its first step (bad data, a
  missing file, Ctrl-C or a kill during start-up).  Such a directory is taken for the new run,
  with one line saying so, and its config.yaml is replaced.  Anything else in it (metrics,
  checkpoints, samples, a file of yours) makes a new run refuse it; `--resume` continues it.
  So a run that fails early needs no clean-up, also after a SIGKILL.
- The lock: a second `opd train` (new or `--resume`) on a directory whose lock names a live
  process is refused, naming the pid; a lock whose process is gone (killed, crashed) is taken
  over with one line.  A lock written on another host cannot be checked and counts as live
  (delete it by hand once that run is gone).  The lock is released when `opd train` returns.
  Two runs that find the same dead lock at the same instant may both take it over (the lock
  guards against a second command by a person, not against a race of milliseconds).
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Callable

from opd.config.schema import RunConfig, default_run_dir, load_config
from opd.config.loader import ConfigError
from opd.config.files import config_to_dict, save_config

CONFIG_FILE = "config.yaml"
LOCK_FILE = "lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked."""


def missing_keys(saved: dict, full: dict, prefix: str = "") -> list[str]:
    """The dotted keys of `full` (a resolved config's dict) that `saved` lacks, sections
    recursed into."""
    out = []
    for key, value in full.items():
        if key not in saved:
            out.append(prefix + key)
        elif isinstance(value, dict) and isinstance(saved[key], dict):
            out += missing_keys(saved[key], value, f"{prefix}{key}.")
    return out


def check_saved_config(run_dir: str | os.PathLike) -> None:
    """ConfigError unless the run's config.yaml holds every key of a resolved config, as the
    run saved it.  One cut short or with keys deleted would otherwise load, the missing keys
    taking their defaults, and the resumed steps would silently be another run's (other
    data, model or schedule; a cut `data.data_dir` even prepares a data set elsewhere).
    A file that is not YAML mapping is left to `load_config`, which names the problem."""
    import yaml
    path = Path(run_dir) / CONFIG_FILE
    try:
        saved = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return
    if not isinstance(saved, dict):
        return
    gone = missing_keys(saved, config_to_dict(load_config(None)))
    if gone:
        more = f" (+{len(gone) - 4} more)" if len(gone) > 4 else ""
        raise ConfigError(f"{path} lacks {', '.join(gone[:4])}{more}: it was cut short or "
                          f"edited, and resuming would run with defaults for them; restore it "
                          f"from a copy of the run (or write the missing keys back with the "
                          f"values the run used)", gone[0])


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _me() -> tuple[int, str]:
    return os.getpid(), socket.gethostname()


def lock_holder(path: str | os.PathLike) -> tuple[int, str] | None:
    """(pid, host) written in `path/lock`, or None when there is no readable lock."""
    try:
        pid, host = (Path(path) / LOCK_FILE).read_text().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def _alive(pid: int, host: str) -> bool:
    if host != socket.gethostname():
        return True                       # another machine's process: cannot tell, assume live
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                       # another user's live process
    return True


def acquire_lock(path: str | os.PathLike, report: Callable[[str], None] = _stderr) -> Path:
    """Write `path/lock` for this process.  A lock of a live process: RunDirError naming it; of
    a process that is gone (or unreadable): taken over, saying so through `report`."""
    path = Path(path)
    lock = path / LOCK_FILE
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock_holder(path)
            if holder == _me():
                return lock                       # this process holds it already
            if holder is not None and _alive(*holder):
                raise RunDirError(f"run directory {path} is in use by another opd train (pid "
                                  f"{holder[0]} on {holder[1]}, {lock}); wait for it or stop it, "
                                  f"or delete {lock} if that process is gone") from None
            report(f"opd train: taking over {lock} from pid {holder[0]}, which is no longer "
                   f"running" if holder else f"opd train: taking over {lock}, which is unreadable")
            lock.unlink(missing_ok=True)
            continue
        except OSError as e:
            raise RunDirError(f"cannot write to run directory {path} ({e.strerror}); choose a "
                              f"run.dir you can write to") from None
        with os.fdopen(fd, "w") as f:
            f.write("%d %s\n" % _me())
        return lock
    raise RunDirError(f"run directory {path}: another opd train keeps taking {lock}; "
                      f"run one at a time")


def release_lock(path: str | os.PathLike) -> None:
    """Remove `path/lock` if this process holds it."""
    if lock_holder(path) == _me():
        (Path(path) / LOCK_FILE).unlink(missing_ok=True)


def prepare_run_dir(cfg: RunConfig, *, resume: bool = False,
                    report: Callable[[str], None] = _stderr) -> Path:
    """Create (or, when resuming, reopen) the run directory, take its lock and save the
    resolved config (new runs).  Release the lock with `release_lock` when the run ends."""
    path = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
    if resume:
        if not (path / CONFIG_FILE).is_file():
            raise RunDirError(f"cannot resume from {path}: it holds no {CONFIG_FILE}; pass the "
                              "directory of an earlier run")
        acquire_lock(path, report)
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create run directory {path} ({e.strerror}); choose a run.dir "
                          f"you can write to") from None
    acquire_lock(path, report)
    left = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)
    if left and left != [CONFIG_FILE]:
        release_lock(path)
        raise RunDirError(f"run directory {path} is not empty; choose another run.dir, delete it, "
                          f"or continue that run with --resume {path}")
    if left:
        report(f"opd train: {path} holds only the {CONFIG_FILE} of a run that stopped before its "
               f"first step; starting a new run there")
    try:
        save_config(cfg, path / CONFIG_FILE)
    except OSError as e:
        release_lock(path)
        raise RunDirError(f"cannot write {path / CONFIG_FILE} ({e.strerror}); choose a run.dir "
                          f"you can write to") from None
    return path


__all__ = ["RunDirError", "CONFIG_FILE", "LOCK_FILE", "prepare_run_dir", "acquire_lock",
           "release_lock", "lock_holder", "ConfigError"]
