"""The checkpoint layout of `opd train`, the same in run.mode=reference and run.mode=ray.

    <run>/checkpoints/
        step_000200/
            student.pt      {"model": state dict}: the student in LlamaGen's key layout, fp32, CPU
                            (what a LlamaGen c2i_*.pt holds; `opd.models.load_llamagen_checkpoint`
                            and `opd export` read it)
            optimizer/      the optimizer state of the backend: torch's `optimizer.pt`
                            (reference) or DeepSpeed's own files (ray, every learner rank)
            state.json      step, policy_version, data cursor, mode, config_hash, consumed
                            batch ids (ray), `files`: the size of every other file, and
                            `crc32`: the CRC-32 of every other file (8 hex digits)
        step_000400.tmp/    a checkpoint being written (or whose writer died): never read
        latest              the name of the newest committed step directory (text)

A checkpoint is written into `step_N.tmp/` (`begin`), its files first and `state.json` last
(`commit`), then renamed to `step_N/` (os.replace) and `latest` updated (write + os.replace).
So a `step_N/` directory is complete when it exists; `damage` also checks that every file
`state.json` lists has its recorded size and CRC-32 (a truncated, deleted or overwritten file:
damaged, never loaded).  Readers (`latest_checkpoint`, `find_checkpoint`) take the newest
complete step directory by scanning, so a crash between the rename and the update of `latest`
loses nothing; `latest` is for people and other tools (`cat checkpoints/latest`).  When the
newest is damaged they fall back to the one before and say so in one line (stderr): which one
was skipped, why, which one is used.

The checksum is CRC-32 (zlib, hardware-accelerated): it is there to catch accidental damage
(a torn or truncated write, a disk error, a file copied in part), not tampering, and it is the
cheapest full-content check the standard library has: 0.8 GB/s on one core of this 2-core CPU
against 0.5 GB/s for SHA-256, so a LlamaGen-L checkpoint (student + AdamW state, ~4 GB) costs
~5 s to hash when written and again when resumed; a 64-token digits checkpoint, milliseconds.
Old manifests without `crc32` are checked by size only.

A write that fails (a full disk, a directory that cannot be written) raises
`CheckpointWriteError` naming the checkpoint and the fix, after removing its step_N.tmp;
earlier checkpoints are not touched.

Used by the reference loop (opd/run/reference.py), the Ray run records (actors/driver/records.py, the
driver commits after every learner rank has saved), `opd eval`, `opd export` and `opd bench`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor

from opd.config.schema import RunConfig
from opd.config.loader import ConfigError
from opd.config.files import config_hash, config_to_dict
from opd.models.safe_load import CheckpointError

CHECKPOINTS = "checkpoints"
STUDENT_FILE = "student.pt"
STATE_FILE = "state.json"
OPTIMIZER_DIR = "optimizer"
TORCH_OPTIMIZER_FILE = "optimizer.pt"      # in OPTIMIZER_DIR, run.mode=reference
LATEST_FILE = "latest"
TMP_SUFFIX = ".tmp"
STEP_DIR = re.compile(r"step_(\d+)")
CHUNK = 4 << 20                            # bytes read at a time when hashing


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, no permission); earlier ones are intact."""


def step_name(step: int) -> str:
    """The directory name of the checkpoint after `step` learner steps: step_000200."""
    return f"step_{step:06d}"


def begin(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh, empty `checkpoints/step_N.tmp/` with its `optimizer/` sub-folder (a leftover of
    an earlier attempt is removed); write the files there, then `commit` it."""
    tmp = Path(run_dir) / CHECKPOINTS / (step_name(step) + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / OPTIMIZER_DIR).mkdir(parents=True)
    return tmp


def student_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A module's state dict as student.pt stores it: detached, fp32 (floating tensors), CPU."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
            for k, v in state.items()}


def checkpoint_state(cfg: RunConfig, step: int, data: dict, mode: str, **extra) -> dict:
    """The state.json of a checkpoint after `step` learner steps (policy version = step):
    `data` the data cursor (PrefixBatcher.state_dict) before the next step's batch, `mode`
    run.mode, `config_hash` the resolved config's hash without run.dir (where the run lives,
    not what it does), plus `extra` (ray: `consumed`)."""
    conf = config_to_dict(cfg)
    conf["run"] = {k: v for k, v in conf["run"].items() if k != "dir"}
    return {"step": step, "policy_version": step, "data": data, "mode": mode,
            "config_hash": config_hash(conf), **extra}


def save_torch(obj, path: str | os.PathLike) -> None:
    """torch.save through a Python file: a full disk raises OSError(ENOSPC), which torch's own
    writer would turn into a RuntimeError about zip positions."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def write_student(ckpt_dir: str | os.PathLike, state: dict[str, Tensor]) -> Path:
    """`ckpt_dir/student.pt` = {"model": student_state(state)}."""
    path = Path(ckpt_dir) / STUDENT_FILE
    save_torch({"model": student_state(state)}, path)
    return path


def file_crc32(path: str | os.PathLike) -> str:
    """The CRC-32 of a file's bytes as 8 hex digits (read in CHUNK-byte pieces)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


@contextmanager
def writing(run_dir: str | os.PathLike, step: int) -> Iterator[Path]:
    """`begin` the checkpoint of `step` and yield its step_N.tmp; an OSError while the block
    writes (and commits) it removes the partial directory and becomes CheckpointWriteError."""
    tmp = None
    try:
        tmp = begin(run_dir, step)
        yield tmp
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(run_dir, report=None)
        raise CheckpointWriteError(
            f"cannot write checkpoint {Path(run_dir) / CHECKPOINTS / step_name(step)} "
            f"({e.strerror or e}); free space on that disk or make it writable, then continue "
            f"with: opd train --resume {run_dir} (its last complete checkpoint: "
            f"{last.name if last else 'none'})") from None


def commit(tmp: str | os.PathLike, state: dict) -> Path:
    """Finish the checkpoint in `tmp` (step_N.tmp, every file written): add `state.json`
    (`state` plus `files` and `crc32`, the size and checksum of each file), rename it to step_N
    and point `latest` at it.  Returns the final directory."""
    tmp = Path(tmp)
    if not (tmp / STUDENT_FILE).is_file():
        raise CheckpointError(f"{tmp} holds no {STUDENT_FILE}; the checkpoint was not written")
    paths = {p.relative_to(tmp).as_posix(): p
             for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != STATE_FILE}
    files = {name: p.stat().st_size for name, p in paths.items()}
    crcs = {name: file_crc32(p) for name, p in paths.items()}
    _write_text(tmp / STATE_FILE,
                json.dumps({**state, "files": files, "crc32": crcs}, indent=1) + "\n")
    final = tmp.with_name(tmp.name[:-len(TMP_SUFFIX)])
    if final.exists():                      # the same step saved again (a resumed run)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text(final.parent / LATEST_FILE, final.name + "\n")
    return final


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_text(text)
    os.replace(tmp, path)


def read_state(ckpt_dir: str | os.PathLike, mode: str | None = None) -> dict:
    """The checkpoint's state.json (step, policy_version, data, mode, config_hash, files, ...).
    With `mode` (resume): a ConfigError unless the checkpoint was written by that run.mode."""
    path = Path(ckpt_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}); the checkpoint is "
                              f"incomplete or damaged, use an earlier one") from None
    if mode is not None and state.get("mode") != mode:
        raise ConfigError(f"{ckpt_dir} was written by a run.mode={state.get('mode')} run; resume "
                          f"it with run.mode={state.get('mode')} (the optimizer states differ)",
                          "run.mode")
    return state


def damage(ckpt_dir: str | os.PathLike) -> str | None:
    """Why `ckpt_dir` is not a complete checkpoint (one sentence), or None if it is: every file
    state.json lists is there with its size and (newer manifests) its CRC-32."""
    path = Path(ckpt_dir)
    if path.name.endswith(TMP_SUFFIX):
        return f"{path} is a checkpoint whose writing did not finish"
    m = STEP_DIR.fullmatch(path.name)
    if not path.is_dir() or m is None:
        return f"{path} is not a checkpoints/step_N directory"
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"{path} has no readable {STATE_FILE}"
    if int(state.get("step", -1)) != int(m.group(1)) or not isinstance(state.get("files"), dict):
        return f"{path / STATE_FILE} does not describe step {int(m.group(1))}"
    if STUDENT_FILE not in state["files"]:
        return f"{path} lists no {STUDENT_FILE}"
    for name, size in state["files"].items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, not the {size} it was written with"
    for name, crc in (state.get("crc32") or {}).items():
        try:
            if file_crc32(path / name) != crc:
                return f"{path / name} has another CRC-32 than when it was written"
        except OSError as e:
            return f"{path / name} cannot be read ({e.strerror})"
    return None


def is_complete(ckpt_dir: str | os.PathLike) -> bool:
    return damage(ckpt_dir) is None


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """The run's committed step_N directories (complete or damaged; no *.tmp), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def newest_complete(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint or None, "step_N (why)" of each newer damaged one)."""
    skipped = []
    for path in reversed(checkpoint_dirs(run_dir)):
        why = damage(path)
        if why is None:
            return path, skipped
        skipped.append(f"{path.name} ({why})")
    return None, skipped


def latest_checkpoint(run_dir: str | os.PathLike,
                      report: Callable[[str], None] | None = _stderr) -> Path | None:
    """The newest complete checkpoint of a run (None: there is none); `step_N.tmp` directories
    are never considered.  Damaged newer ones are skipped, and `report` (default: stderr) gets
    one line naming them, why, and the checkpoint used instead."""
    found, skipped = newest_complete(run_dir)
    if skipped and report is not None:
        report(_fallback_line(skipped, found))
    return found


def _fallback_line(skipped: list[str], found: Path | None) -> str:
    used = f"using {found}" if found else "no complete checkpoint is left: starting at step 0"
    return (f"opd: skipped damaged checkpoint{'s' if len(skipped) > 1 else ''} "
            f"{'; '.join(skipped)}; {used}")


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(checkpoint directory, its run directory or None) for a run directory (one holding
    config.yaml or checkpoints/: its newest complete checkpoint), its checkpoints/ folder (the
    same) or a checkpoints/step_N directory.  Raises CheckpointError naming the path and the fix."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise CheckpointError(f"{path} {what}; pass a run directory of opd train or its "
                              f"{CHECKPOINTS}/step_N directory")
    if path.name == CHECKPOINTS and not (path / CHECKPOINTS).is_dir():
        path = path.parent
    if (path / "config.yaml").is_file() or (path / CHECKPOINTS).is_dir():
        ckpt, skipped = newest_complete(path)
        if ckpt is None:
            why = f" (damaged: {'; '.join(skipped)})" if skipped else " yet"
            raise CheckpointError(f"run directory {path} holds no complete checkpoint "
                                  f"({CHECKPOINTS}/step_N/{STUDENT_FILE}){why}; train it "
                                  f"(opd train, --resume) or wait for its first one "
                                  f"(run.checkpoint_every)")
        if skipped:
            _stderr(_fallback_line(skipped, ckpt))
        return ckpt, path
    why = damage(path)
    if why is not None:
        raise CheckpointError(f"{why}; pass a run directory (its newest complete checkpoint) "
                              f"or a complete {CHECKPOINTS}/step_N directory")
    run_dir = path.parent.parent
    return path, (run_dir if (run_dir / "config.yaml").is_file() else None)


def student_file(path: str | os.PathLike) -> Path:
    """The weights file behind `path`: a run or checkpoint directory's student.pt (see
    `find_checkpoint`), or `path` itself when it is a file (a c2i_*.pt)."""
    path = Path(path)
    return find_checkpoint(path)[0] / STUDENT_FILE if path.is_dir() else path


def checkpoint_step(ckpt_dir: str | os.PathLike) -> int:
    """The learner step a complete checkpoint was written after (its state.json)."""
    return int(read_state(ckpt_dir)["step"])


__all__ = ["CHECKPOINTS", "STUDENT_FILE", "STATE_FILE", "OPTIMIZER_DIR", "TORCH_OPTIMIZER_FILE",
           "LATEST_FILE", "CheckpointWriteError", "step_name", "begin", "writing", "checkpoint_state",
           "student_state", "save_torch", "write_student", "file_crc32", "commit",
           "read_state", "damage", "is_complete", "checkpoint_dirs", "latest_checkpoint",
           "newest_complete", "find_checkpoint", "student_file", "checkpoint_step"]
