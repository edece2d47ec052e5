"""Bad input at scale: generated cases (hypothesis) of everything a user hands `opd`, checked
by one property, in-process (`launch.cli.main`, run.mode=reference, tiny preset):

    the command exits 2 (or, for input that turns out valid, 0), prints exactly one line on
    stderr, `opd: error: ...`, naming the key or file, and no traceback; an existing run
    directory is byte for byte as it was (hashes before and after).

Inputs: config (random dotted overrides and YAML presets: unknown keys, wrong types,
out-of-range values, phases lists, ranges, nested merges), data (Parquet files with a wrong
schema, token dtype or metadata, tokens >= vocab or < 0, labels out of range, rows of unequal
length, empty or truncated files, a directory where the file should be), checkpoints
(truncated, wrong keys, shapes, dtypes, pickles that would run code, a state.json that lies
about sizes or CRCs, a `latest` that points nowhere), CLI argument strings and run directories
(a lock held by a live or a dead pid, *.tmp directories, an edited config.yaml, a missing
metrics.parquet).

Two profiles: the default one runs a few examples per input (seconds, in the default suite);
`-m fuzz` runs FUZZ_EXAMPLES each (minutes) and `fuzz_report` (the last test) prints what the
run saw: cases, distinct messages, tracebacks, files changed (docs/RELIABILITY.md has a run's).

Over 400 lines: one generator per kind of input (configs, data files, checkpoints, run
directories) beside the one property they share, and the report that tallies them all.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import string
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from launch.cli import main
from opd.data import write_token_parquet

FAST_EXAMPLES, FUZZ_EXAMPLES = 6, 150
STEPS = 2
SEEN: dict[str, Counter] = {"cases": Counter(), "messages": Counter(), "tracebacks": Counter(),
                            "changed": Counter(), "exit0": Counter()}


def fresh(tmp_path: Path, stem: str) -> Path:
    """A path under tmp_path that no earlier example used (examples share one tmp_path)."""
    fresh.n += 1
    return tmp_path / f"{stem}{fresh.n}"


fresh.n = 0


def profile(fuzz: bool):
    """Hypothesis settings of a profile: derandomized in the default suite (always the same
    few cases), random in the fuzz one."""
    return settings(max_examples=FUZZ_EXAMPLES if fuzz else FAST_EXAMPLES, deadline=None,
                    derandomize=not fuzz, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


def tiny(digits_dir) -> list[str]:
    return ["--config", "tiny", f"data.data_dir={digits_dir}", "run.mode=reference",
            "eval.track=false", f"distill.steps={STEPS}", "rollout.decoding=greedy",
            "rollout.gamma=2", "run.checkpoint_every=1"]


def digest(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def run_cli(kind: str, argv: list[str], names: list[str], *, allow_ok: bool = False,
            watch: Path | None = None, watch_except: tuple[str, ...] = ()) -> str:
    """`opd argv` in-process; asserts the property (module docstring); returns the line."""
    before = digest(watch) if watch is not None else None
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:                      # argparse
            code = e.code
        except Exception as e:                       # noqa: BLE001  (the property: none escape)
            SEEN["tracebacks"][kind] += 1
            raise AssertionError(f"{kind}: {argv} raised {type(e).__name__}: {e}") from e
    SEEN["cases"][kind] += 1
    text = err.getvalue()
    lines = [ln for ln in text.split("\n") if ln.strip() and not ln.startswith("\r")
             and not ln.startswith("opd train: ")]              # notes of a run that started
    if watch is not None:
        after = digest(watch)
        changed = {k for k in set(before) | set(after)
                   if before.get(k) != after.get(k) and k not in watch_except}
        if changed:
            SEEN["changed"][kind] += 1
        assert not changed, f"{kind}: {argv} changed {sorted(changed)} in {watch}"
    assert "Traceback" not in text, f"{kind}: {argv}\n{text}"
    if code == 0 and allow_ok:
        SEEN["exit0"][kind] += 1
        return ""
    assert code == 2, f"{kind}: {argv} exited {code}\n{text}"
    if argv and argv[0].startswith("-") or kind == "cli" and lines and lines[0].startswith("usage:"):
        lines = [ln for ln in lines if not ln.startswith(("usage:", " "))]   # argparse's usage
    assert len(lines) == 1, f"{kind}: {argv}: {len(lines)} lines\n{text}"
    line = lines[0]
    assert line.startswith(("opd: error: ", "opd ", "opd: ")), line
    assert any(n in line for n in names), f"{kind}: {argv}: {line!r} names none of {names}"
    SEEN["messages"][re.sub(r"\d+|'[^']*'|/\S+", "_", line)[:160]] += 1
    return line


# ---- config ---------------------------------------------------------------------------------

SECTIONS = {"model": ["dtype", "vocab_size", "grid_size", "num_classes", "student"],
            "data": ["batch_size", "prefix_ratio", "prefix_ratios", "dataset"],
            "rollout": ["window", "gamma", "decoding", "temperature", "top_k", "top_p", "engine",
                        "slots", "cfg_scale", "num_workers"],
            "learner": ["lr", "precision", "grad_clip", "betas", "world_size", "zero_stage"],
            "distill": ["steps", "objective", "lam", "beta", "phases", "staleness"],
            "teacher": ["transport", "topk"], "eval": ["every", "num_samples"],
            "run": ["seed", "checkpoint_every", "mode"]}
BAD_VALUES = st.one_of(st.sampled_from(["abc", "-1", "0", "1e99", "nan", "inf", "-inf", "[1,2",
                                        "{a: 1}", "null", "true", "1..8", "8..1", "0..0", "[]",
                                        "[{}]", "[{steps: -1}]", "[{objective: nope}]", "''",
                                        "1.5", "-0.5", "2..", "..3", "[1, x]", "1e-400"]),
                       st.integers(-10 ** 12, 10 ** 12).map(str),
                       st.text(string.printable.replace("=", ""), max_size=12))
KEYS = st.one_of(
    st.sampled_from([f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks]),
    st.tuples(st.sampled_from(list(SECTIONS)), st.text(string.ascii_lowercase + "_", min_size=1,
                                                       max_size=10)).map(".".join),
    st.sampled_from(["distill.phases.0.steps", "distill.phases.5.lam", "distill.phases.x",
                     "model", "nosuch.key", "rollout..window", ".x", "distill.phases.0.nope"]))


def is_valid(overrides: list[str]) -> bool:
    from opd.config.schema import load_config
    from opd.config.loader import ConfigError
    try:
        load_config("tiny", overrides)
        return True
    except ConfigError:
        return False
    except Exception:                               # noqa: BLE001  (the CLI call shows it)
        return False


def config_property(digits_dir, tmp_path, existing, overrides):
    run, _ = existing
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    names = [k for key in keys for k in (key, key.split(".")[0], key.rsplit(".", 1)[-1]) if k]
    names += [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[1].strip()]
    if is_valid([f"data.data_dir={digits_dir}", *overrides]):
        return                       # valid overrides start a run: not this property's business
    run_cli("config", ["train", *tiny(digits_dir), *overrides, f"run.dir={run}"], names,
            watch=run)


# ---- data -----------------------------------------------------------------------------------

MUTATIONS = ["token_high", "token_negative", "label_high", "label_negative", "ragged", "float_tokens",
             "string_labels", "no_tokens", "no_label", "no_metadata", "bad_metadata",
             "meta_vocab", "meta_grid", "empty_file", "truncated", "directory", "zero_rows",
             "null_row", "garbage"]


def data_file(tmp: Path, mutations: list[str], rng: np.random.Generator, cut: float) -> Path:
    """train.parquet (tiny's shape: vocab 17, 10 classes, 8x8 grid) with `mutations` applied."""
    d = fresh(tmp, "data")
    d.mkdir()
    n = int(rng.integers(1, 6))
    labels = rng.integers(0, 10, n)
    tokens = rng.integers(0, 17, (n, 64))
    good = d / "good.parquet"
    write_token_parquet(good, labels, tokens, vocab_size=17, num_classes=10, grid_size=8,
                        tokenizer="digits-v1")
    table = pq.read_table(good)
    meta = dict(table.schema.metadata)
    rows = [list(map(int, r)) for r in tokens]
    labs = [int(x) for x in labels]
    # tokens are corrupted before rows are cut short or nulled; zero_rows empties the file last
    late = {"ragged": 1, "null_row": 2, "zero_rows": 3}
    for m in sorted(mutations, key=lambda m: late.get(m, 0)):
        i = int(rng.integers(n))
        if m == "token_high":
            rows[i][int(rng.integers(64))] = int(rng.integers(17, 1 << 30))
        elif m == "token_negative":
            rows[i][int(rng.integers(64))] = -int(rng.integers(1, 1 << 30))
        elif m == "label_high":
            labs[i] = int(rng.integers(10, 1 << 30))
        elif m == "label_negative":
            labs[i] = -int(rng.integers(1, 100))
        elif m == "ragged":
            rows[i] = rows[i][: int(rng.integers(0, 64))]
        elif m == "null_row":
            rows[i] = None
        elif m == "zero_rows":
            rows, labs = [], []
            n = 0
        elif m == "bad_metadata":
            meta[b"opd"] = bytes(rng.integers(0, 256, int(rng.integers(0, 40))).astype(np.uint8))
        elif m == "meta_vocab":
            meta[b"opd"] = meta[b"opd"].replace(b'"vocab_size": 17', b'"vocab_size": %d'
                                                % rng.choice([0, -3, 16, 4096]))
        elif m == "meta_grid":
            meta[b"opd"] = meta[b"opd"].replace(b'"grid_size": 8', b'"grid_size": %d'
                                                % rng.choice([0, 7, 16]))
    cols = {"label": pa.array(labs, pa.int64()),
            "tokens": pa.array(rows, pa.list_(pa.int32()))}
    if "float_tokens" in mutations:
        cols["tokens"] = pa.array([None if r is None else [float(x) + 0.5 for x in r] for r in rows],
                                  pa.list_(pa.float64()))
    if "string_labels" in mutations:
        cols["label"] = pa.array([str(x) for x in labs])
    for m, col in (("no_tokens", "tokens"), ("no_label", "label")):
        if m in mutations:
            del cols[col]
    if "no_metadata" in mutations:
        meta = {}
    out = d / "train.parquet"
    pq.write_table(pa.table(cols).replace_schema_metadata(meta or None), out)
    good.unlink()
    whole = out.read_bytes()
    if "truncated" in mutations:
        out.write_bytes(whole[: int(len(whole) * cut)])
    if "empty_file" in mutations:
        out.write_bytes(b"")
    if "garbage" in mutations:
        out.write_bytes(bytes(rng.integers(0, 256, int(rng.integers(1, 2000))).astype(np.uint8)))
    if "directory" in mutations:
        out.unlink()
        out.mkdir()
    return d


# ---- checkpoints ----------------------------------------------------------------------------

class RunsCode:
    """A pickle that would create a file when loaded (it must never be loaded)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


CKPT_MUTATIONS = ["truncate", "drop_key", "extra_key", "shape", "dtype", "int_tensor",
                  "code", "not_dict", "nested_model", "nan", "garbage", "zip_member",
                  "empty", "directory"]


def checkpoint_file(tmp: Path, student: dict, mutation: str, rng: np.random.Generator,
                    marker: Path) -> Path:
    path = fresh(tmp, "ckpt").with_suffix(".pt")
    state = {k: v.clone() for k, v in student.items()}
    keys = sorted(state)
    k = keys[int(rng.integers(len(keys)))]
    obj: object = state
    if mutation == "drop_key":
        del state[k]
    elif mutation == "extra_key":
        state[f"layers.99.{k}"] = state[k]
    elif mutation == "shape":
        state[k] = torch.zeros(*[s + int(rng.integers(1, 3)) for s in state[k].shape] or [2])
    elif mutation == "dtype":
        state[k] = state[k].to(torch.complex64)
    elif mutation == "int_tensor":
        state[k] = state[k].to(torch.int64)
    elif mutation == "code":
        obj = {"model": state, "args": RunsCode(str(marker))}
    elif mutation == "not_dict":
        obj = [1, 2, 3] if rng.integers(2) else "a string"
    elif mutation == "nested_model":
        obj = {"model": {"model": state}}
    elif mutation == "nan":
        state[k] = torch.full_like(state[k], float("nan"))
    if mutation == "code":
        with open(path, "wb") as f:
            pickle.dump(obj, f)                     # a plain (legacy) pickle, as old files are
    else:
        torch.save(obj, path)
    whole = path.read_bytes()
    if mutation == "truncate":
        path.write_bytes(whole[: int(rng.integers(0, len(whole)))])
    elif mutation == "garbage":
        path.write_bytes(bytes(rng.integers(0, 256, 3000).astype(np.uint8)))
    elif mutation == "empty":
        path.write_bytes(b"")
    elif mutation == "zip_member":                  # a torch zip whose data.pkl runs code
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/data.pkl", pickle.dumps(RunsCode(str(marker))))
            z.writestr("archive/version", "3\n")
    elif mutation == "directory":
        path.unlink()
        path.mkdir()
    return path


# ---- run directories --------------------------------------------------------------------------

RUN_MUTATIONS = ["lock_live", "lock_dead", "lock_garbage", "tmp_dir", "edit_config",
                 "break_config", "no_metrics", "latest_nowhere", "state_size", "state_crc",
                 "state_garbage", "drop_student", "truncate_student", "no_checkpoints"]


def mutate_run(run: Path, mutation: str, rng: np.random.Generator, live_pid: int) -> None:
    import socket
    ck = run / "checkpoints"
    steps = sorted(p for p in ck.glob("step_*") if p.is_dir() and p.suffix != ".tmp")
    last = steps[-1] if steps else None
    if mutation == "lock_live":
        (run / "lock").write_text(f"{live_pid} {socket.gethostname()}\n")
    elif mutation == "lock_dead":
        (run / "lock").write_text(f"{2 ** 22 + int(rng.integers(1000))} {socket.gethostname()}\n")
    elif mutation == "lock_garbage":
        (run / "lock").write_bytes(bytes(rng.integers(0, 256, 20).astype(np.uint8)))
    elif mutation == "tmp_dir":
        t = ck / f"step_{99 + int(rng.integers(100)):06d}.tmp"
        t.mkdir(parents=True, exist_ok=True)
        (t / "student.pt").write_bytes(b"partial")
    elif mutation == "edit_config":
        text = (run / "config.yaml").read_text()
        (run / "config.yaml").write_text(text.replace("window: 4", f"window: {rng.choice(['x', -2, 0, 99])}"))
    elif mutation == "break_config":
        text = (run / "config.yaml").read_text()
        cut = int(rng.integers(0, len(text)))
        (run / "config.yaml").write_text(text[:cut] + rng.choice(["\n: [", "\n\tx", "\nnew_key: 1\n", ""]))
    elif mutation == "no_metrics":
        (run / "metrics.parquet").unlink(missing_ok=True)
    elif mutation == "latest_nowhere" and ck.is_dir():
        (ck / "latest").write_text(f"step_{int(rng.integers(10 ** 6)):06d}\n")
    elif mutation in ("state_size", "state_crc", "state_garbage") and last is not None:
        try:
            state = json.loads((last / "state.json").read_text())
        except ValueError:                   # garbled by an earlier mutation already
            return
        text = json.dumps(state)
        if mutation == "state_garbage":
            text = text[: int(rng.integers(0, len(text)))]
        else:
            field = "size" if mutation == "state_size" else "crc"
            text = re.sub(rf'"{field}[a-z0-9_]*": (\d+)', lambda m: m.group(0)[:-len(m.group(1))]
                          + str(int(m.group(1)) + 1 + int(rng.integers(100))), text)
        (last / "state.json").write_text(text)
    elif mutation == "drop_student" and last is not None:
        (last / "student.pt").unlink()
    elif mutation == "truncate_student" and last is not None and (last / "student.pt").is_file():
        b = (last / "student.pt").read_bytes()
        (last / "student.pt").write_bytes(b[: int(rng.integers(0, len(b)))])
    elif mutation == "no_checkpoints":
        shutil.rmtree(ck)


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def existing(tmp_path_factory, digits_dir):
    """A finished tiny run (checkpoints every step)."""
    run = tmp_path_factory.mktemp("fuzz_existing") / "run"
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", *tiny(digits_dir), f"run.dir={run}"]) == 0
    return run, digest(run)


@pytest.fixture(scope="module")
def live_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    yield p.pid
    p.kill()
    p.wait()


def all_tests(fuzz: bool):
    """The property tests of one profile (module-level names made below)."""
    s = profile(fuzz)
    mark = [pytest.mark.fuzz] if fuzz else []

    @s
    @given(overrides=st.lists(st.tuples(KEYS, BAD_VALUES).map("=".join), min_size=1, max_size=3))
    def config_overrides(digits_dir, tmp_path, existing, overrides):
        config_property(digits_dir, tmp_path, existing, overrides)

    @s
    @given(doc=st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(-5, 10 ** 6), st.floats(allow_nan=True),
                  st.text(max_size=8), st.sampled_from(["1..8", "bfloat16", "gkd", "tiny"])),
        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                st.dictionaries(st.one_of(st.sampled_from(
                                    [*SECTIONS, *[k for ks in SECTIONS.values() for k in ks],
                                     "extends", "phases"]), st.text(max_size=6)), inner,
                                    max_size=4)), max_leaves=12),
           extends=st.sampled_from([None, "tiny", "default", "nope", "../tiny"]))
    def config_yaml(digits_dir, tmp_path, existing, doc, extends):
        import yaml
        run, _ = existing
        if isinstance(doc, dict) and extends is not None:
            doc = {"extends": extends, **doc}
        path = fresh(tmp_path, "preset").with_suffix(".yaml")
        path.write_text(yaml.safe_dump(doc))
        from opd.config.schema import load_config
        from opd.config.loader import ConfigError
        try:
            load_config(str(path), [f"data.data_dir={digits_dir}"])
            return                                    # a valid preset
        except ConfigError:
            pass
        except Exception:                             # noqa: BLE001  (the CLI call shows it)
            pass
        run_cli("yaml", ["train", "--config", str(path), f"data.data_dir={digits_dir}",
                         "run.mode=reference", "distill.steps=1", f"run.dir={run}"],
                [str(path), *SECTIONS, "extends", "phases", "config", "key"], watch=run)

    @s
    @given(mutations=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3, unique=True),
           seed=st.integers(0, 2 ** 32 - 1), cut=st.floats(0.0, 0.99))
    @example(mutations=["null_row", "token_high"], seed=6, cut=0.0)   # the long profile's finds:
    @example(mutations=["null_row", "token_negative"], seed=6, cut=0.0)  # a row nulled or cut,
    @example(mutations=["ragged", "token_high"], seed=0, cut=0.0)        # then its token hit
    def data_files(digits_dir, tmp_path, existing, mutations, seed, cut):
        run, _ = existing
        d = data_file(tmp_path, mutations, np.random.default_rng(seed), cut)
        run_cli("data", ["train", *tiny(digits_dir), "data.dataset=parquet", f"data.data_dir={d}",
                         "distill.steps=1", f"run.dir={fresh(tmp_path, 'new')}"],
                [str(d / "train.parquet"), str(d)], allow_ok=True, watch=run)

    @s
    @given(mutation=st.sampled_from(CKPT_MUTATIONS), seed=st.integers(0, 2 ** 32 - 1),
           role=st.sampled_from(["student", "teacher"]))
    def checkpoints(digits_dir, tmp_path, existing, mutation, seed, role):
        run, _ = existing
        from opd.models import load_state_dict_safely
        student = load_state_dict_safely(run / "checkpoints/step_000002/student.pt")
        if role == "teacher":
            from opd.config.schema import load_config
            from opd.models.factory import load_role_model
            student = load_role_model(load_config("tiny", [f"data.data_dir={digits_dir}"]),
                                      "teacher", progress=False).state_dict()
        marker = fresh(tmp_path, "ran")
        path = checkpoint_file(tmp_path, student, mutation, np.random.default_rng(seed), marker)
        run_cli("checkpoint", ["train", *tiny(digits_dir), f"model.{role}_ckpt={path}",
                               "distill.steps=1", f"run.dir={fresh(tmp_path, 'new')}"],
                [str(path)], watch=run)
        assert not marker.exists(), f"loading {mutation} ran pickled code"

    @s
    @given(argv=st.lists(st.one_of(
        st.sampled_from(["train", "eval", "export", "prepare", "bench", "calibrate", "pretrain",
                         "--config", "--resume", "--ckpt", "--out", "-h", "--print-config",
                         "digits", "rollout", "x=1", "rollout.window=", "=", "--", "-",
                         "tiny", "/nonexistent", "run.dir=/nonexistent/x", "--steps"]),
        st.text(string.printable, max_size=10)), max_size=5))
    def cli_arguments(tmp_path, existing, argv):
        run, _ = existing
        if any(a in ("-h", "--help") or a.startswith("--h") for a in argv) or not argv:
            return                                    # help is not an error
        if argv[0] in ("train", "pretrain", "bench", "calibrate", "prepare") and not any(
                a.startswith("-") or "=" in a for a in argv[1:]):
            argv = [*argv, "run.dir=/nonexistent-fuzz/x=y=z"]   # never a long run
        before = digest(run)
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
            except Exception as e:                    # noqa: BLE001
                SEEN["tracebacks"]["cli"] += 1
                raise AssertionError(f"cli: {argv} raised {type(e).__name__}: {e}") from e
        SEEN["cases"]["cli"] += 1
        assert digest(run) == before
        assert code in (0, 2, None), (argv, code, buf.getvalue())
        text = buf.getvalue()
        assert "Traceback" not in text, text
        if code == 2:
            errors = [ln for ln in text.splitlines() if "error:" in ln]
            assert len(errors) == 1, (argv, text)
            SEEN["messages"][re.sub(r"\d+|'[^']*'|/\S+", "_", errors[0])[:160]] += 1

    @s
    @given(mutations=st.lists(st.sampled_from(RUN_MUTATIONS), min_size=1, max_size=3, unique=True),
           seed=st.integers(0, 2 ** 32 - 1), resume=st.booleans())
    def run_directories(digits_dir, tmp_path, existing, live_pid, mutations, seed, resume):
        run, _ = existing
        copy = fresh(tmp_path, "run")
        shutil.copytree(run, copy)
        rng = np.random.default_rng(seed)
        for m in mutations:
            mutate_run(copy, m, rng, live_pid)
        stale = ("lock",) if any(m in ("lock_dead", "lock_garbage") for m in mutations) else ()
        if resume:          # resuming may legitimately write (recovering); it must not break
            argv = ["train", "--resume", str(copy)]
            before = digest(copy)
            line = run_cli("rundir", argv, [str(copy), "config", "lock"], allow_ok=True)
            if line:        # refused: nothing changed there (a stale lock may be taken away)
                after = digest(copy)
                assert {k for k in set(before) | set(after) if before.get(k) != after.get(k)} \
                    <= set(stale), (mutations, line)
        else:               # a new run onto an existing directory: refused, nothing changes
            run_cli("rundir", ["train", *tiny(digits_dir), f"run.dir={copy}"],
                    [str(copy)], watch=copy, watch_except=stale)

    tests = {"config_overrides": config_overrides, "config_yaml": config_yaml,
             "data_files": data_files, "checkpoints": checkpoints, "cli_arguments": cli_arguments,
             "run_directories": run_directories}
    for name, fn in tests.items():
        for m in mark:
            fn = m(fn)
        globals()[f"test_{'fuzz_' if fuzz else ''}{name}"] = fn


all_tests(fuzz=False)
all_tests(fuzz=True)


@pytest.mark.fuzz
def test_fuzz_zz_report(capsys):
    """Prints what the fuzz profile saw (run it after the others: `-m fuzz -s`)."""
    report = {"cases": dict(SEEN["cases"]), "cases_total": sum(SEEN["cases"].values()),
              "distinct_messages": len(SEEN["messages"]),
              "tracebacks": sum(SEEN["tracebacks"].values()),
              "files_changed": sum(SEEN["changed"].values()), "valid_inputs": dict(SEEN["exit0"])}
    with capsys.disabled():
        print("\nfuzz report:", json.dumps(report))
    out = os.environ.get("OPD_FUZZ_REPORT")
    if out:
        Path(out).write_text(json.dumps({**report, "messages": SEEN["messages"].most_common()},
                                        indent=1))
    assert report["tracebacks"] == 0 and report["files_changed"] == 0
