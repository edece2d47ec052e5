"""`opd bench schedules`: distillation schedules (arms) side by side over seeds, at equal steps
and at equal wall-clock, with final evaluations large enough that the spread is known.

    opd bench schedules --config schedules_digits8 --out runs/bench/schedules8

A preset (configs/bench/schedules_*.yaml):

    config: null                  run preset of every arm (null: the embedded default)
    overrides: [eval.every=50]    run overrides of every arm (run.mode is always reference)
    steps: 600                    distill.steps of every arm ("equal steps")
    seeds: [0, 1, 2]              run.seed of each repetition
    arms:                         name -> run overrides (`key=value`, as `opd train` takes them)
      kd: [distill.objective=kd]
      gkd: [distill.objective=gkd, distill.lam=1.0]
    equal_time:                   name -> {base: arm, match: arm}: the base arm's overrides
      kd_equal_time: {base: kd, match: gkd}   with the steps that take the matched arm's time
    reference: kd                 the KD-only arm the curves' plateau and crossings refer to
    final_samples: 1000           class-balanced samples of the final evaluation
    final_kl_rows: null           held-out rows of the final KL measures (null: all)
    reuse: true                   keep a finished run whose spec matches (see `run_spec`)

Each (arm, seed) runs `opd.run.reference.run_reference` in OUT/<arm>/seed<k>/ (config.yaml,
metrics.parquet, quality.parquet with the tracked curves, checkpoints), then its final student
is evaluated with `opd.eval.run.evaluate_checkpoint` (FID, precision, recall, IS, class accuracy
on `final_samples` samples; held-out KL(T‖S) `kl_data` and on-policy KL `kl_samples`) into
OUT/<arm>/seed<k>/final/, and OUT/<arm>/seed<k>/result.json holds the run's figures.

Equal wall-clock: steps = the median over seeds of round(W / s), where W is the seed's matched
arm's distillation time and s its base arm's seconds per step, both in CPU seconds of the run's
one process (the sum of metrics.parquet's `step_cpu_s`: rollout + teacher + learner, evaluations
excluded); every seed of the equal-time arm runs that many steps.  With one torch thread a
step's CPU time is its wall time on an idle machine, and it grows less than wall time with what
other processes run beside it (on a shared 2-core machine the wall time of the same run varied
by up to 2x) — but it still grows: a 16x16 run beside three others took 6.7x its quiet CPU time,
its KD run 2.2x, which alone gave that seed 824 equal-time steps against 267 and 276 for the
others.  The median keeps one loaded run from setting the budget; so run an equal-time arm with the
preset's seeds together (`seeds=[1]` alone would budget seed 1 by its own runs).  The learning-rate schedule
scales with distill.steps.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np
from pydantic import Field

from launch.bench import common
from launch.bench.schedules_curves import curve_figures
from opd.config.schema import RunConfig, load_config
from opd.config.loader import ConfigError, strict_schema
from opd.config.files import save_config

RESULT_FILE = "result.json"
FINAL_DIR = "final"
METRICS = ("fid", "precision", "recall", "isc", "class_acc", "kl_data", "kl_samples",
           "exposure_gap", "steps", "wall_s", "cpu_s", "s_per_step", "student_share",
           "rollout_busy_s", "teacher_busy_s", "learner_busy_s")
"""Per-run figures that the summary takes mean and sd of."""


@strict_schema
@dataclass
class SchedulesBench:
    """A preset of `opd bench schedules` (configs/bench/schedules_*.yaml; module docstring)."""

    config: str | None = None
    """Run preset of every arm (a name in configs/ or a YAML path); null = the embedded default."""
    mode: Literal["reference", "ray"] = "reference"
    """run.mode of every arm.  reference: one process, equal time matched on its CPU seconds;
    ray: the real system (rollout, teacher and learner workers, streaming steps), equal time
    matched on wall seconds (the sum of metrics.parquet's step_s: the time between learner
    steps, start-up and the final evaluation excluded)."""
    overrides: list[str] = field(default_factory=list)
    """Run overrides of every arm, before the arm's own (e.g. eval.every=50)."""
    steps: Annotated[int, Field(ge=1)] = 600
    """distill.steps of every arm (equal steps)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """run.seed of each repetition."""
    arms: dict[str, list[str]] = field(default_factory=dict)
    """Arm name -> its run overrides (`key=value`), in table order."""
    equal_time: dict[str, dict[str, str]] = field(default_factory=dict)
    """Arm name -> {base: ARM, match: ARM}: the base arm's overrides with as many steps as fit
    in the matched arm's distillation time (the median over seeds)."""
    final_samples: Annotated[int, Field(ge=4)] = 1000
    """Class-balanced samples of each final evaluation."""
    final_kl_rows: Annotated[int, Field(ge=1)] | None = None
    """Held-out rows of the final held-out and on-policy KL; null = the whole held-out split."""
    reuse: bool = True
    """Keep a run directory whose result.json has the same spec (config, overrides, seed,
    steps, final evaluation settings) instead of training it again."""
    only: list[str] | None = None
    """Run only these arms (an equal-time arm also runs its base and matched arms); null = all.
    Splits a bench over processes: each runs some arms into the same --out, then the full
    command reuses their runs."""
    reference: str | None = "kd"
    """The KD-only arm (or equal-time arm) that quality against training time is stated against
    (launch/bench/schedules_curves.py): its on-policy KL's improvement over the last quarter of
    its budget (the plateau), and when each on-policy arm's crosses below it; compared over the
    time both reached, so give it the on-policy arms' time (an equal-time arm).  null: none."""
    note: str = ""
    """What the table is (printed under its title)."""


def check_schedules(b: SchedulesBench) -> SchedulesBench:
    """What the schema does not say: names, seeds, equal-time references, and that every arm's
    run config loads.  ConfigError naming the bench key."""
    if not b.arms:
        raise ConfigError("bench preset key arms: name at least one arm (name: [key=value, ...])",
                          "arms")
    if not b.seeds or len(set(b.seeds)) != len(b.seeds):
        raise ConfigError(f"bench preset key seeds={b.seeds}: must be distinct seeds, at least "
                          f"one", "seeds")
    for name, spec in b.equal_time.items():
        if name in b.arms:
            raise ConfigError(f"bench preset key equal_time.{name}: the name is already an arm",
                              f"equal_time.{name}")
        common.check_known(spec, ["base", "match"], f"equal_time.{name}", f"equal_time.{name}.")
        for k in ("base", "match"):
            if spec.get(k) not in b.arms:
                raise ConfigError(f"bench preset key equal_time.{name}.{k}={spec.get(k)!r}: must "
                                  f"name one of the arms ({', '.join(b.arms)})",
                                  f"equal_time.{name}.{k}")
    if b.reference is not None and b.reference not in b.arms and b.reference not in b.equal_time:
        raise ConfigError(f"bench preset key reference={b.reference!r}: must name one of the arms "
                          f"({', '.join([*b.arms, *b.equal_time])}) or be null", "reference")
    for name in b.only or []:
        if name not in b.arms and name not in b.equal_time:
            raise ConfigError(f"bench preset key only: {name!r} is not an arm "
                              f"({', '.join([*b.arms, *b.equal_time])})", "only")
    for name in [*b.arms, *b.equal_time]:
        if "/" in name or name.startswith("."):
            raise ConfigError(f"bench preset key arms.{name}: an arm name is a directory name",
                              f"arms.{name}")
        try:
            arm_config(b, name, b.seeds[0], b.steps, Path("."))
        except ConfigError as e:
            raise ConfigError(f"arm {name}: {e}", f"arms.{name}") from None
    return b


def load_schedules_bench(path: str | Path, overrides: dict | None = None) -> SchedulesBench:
    """Read and validate a schedules preset (unknown keys named, with a suggestion)."""
    return check_schedules(common.load_preset(SchedulesBench, path, overrides))


# ---- one run ---------------------------------------------------------------------------------

def arm_overrides(b: SchedulesBench, arm: str) -> list[str]:
    """The run overrides of `arm` (an equal-time arm takes its base arm's)."""
    return list(b.arms[b.equal_time[arm]["base"]] if arm in b.equal_time else b.arms[arm])


def arm_config(b: SchedulesBench, arm: str, seed: int, steps: int, run_dir: Path) -> RunConfig:
    """The run config of (arm, seed): preset, the bench's overrides, distill.steps, the arm's
    overrides, then run.mode (the bench's), run.seed, run.dir."""
    return load_config(b.config, [*b.overrides, f"distill.steps={steps}", *arm_overrides(b, arm),
                                  f"run.mode={b.mode}", f"run.seed={seed}",
                                  f"run.dir={run_dir}", f"run.name={arm}"])


def run_spec(b: SchedulesBench, arm: str, seed: int, steps: int, cfg: RunConfig) -> dict:
    """What a finished run is reused for: the same preset, overrides, arm overrides, seed,
    steps, final evaluation settings, and the same model, data and pretraining sections of the
    resolved config (so a changed pretraining default does not reuse another teacher's runs;
    keys added to other sections later do not void the run)."""
    from opd.config.files import config_to_dict
    return {"config": b.config, "overrides": list(b.overrides), "arm": arm_overrides(b, arm),
            "seed": seed, "steps": steps, "final_samples": b.final_samples,
            "final_kl_rows": b.final_kl_rows,
            "sections": {k: config_to_dict(getattr(cfg, k)) for k in ("model", "data",
                                                                      "pretrain")}}


def run_figures(run_dir: Path) -> dict:
    """From metrics.parquet: steps, distillation seconds (sum of step_s, wall; sum of
    step_cpu_s, the process's CPU), CPU seconds per step and the share of steps whose batch was
    a student rollout."""
    from opd.run.metrics_log import read_metrics
    rows = read_metrics(run_dir)
    wall = float(sum(r["step_s"] for r in rows))
    cpu = float(sum(r.get("step_cpu_s", 0.0) for r in rows))     # reference mode only
    student = sum(r.get("source") == "student" for r in rows)
    busy = {f"{k}_busy_s": float(sum(r.get(f"{k}_busy_s", r.get(f"{k}_s", 0.0)) for r in rows))
            for k in ("rollout", "teacher", "learner")}
    return {"steps": len(rows), "wall_s": wall, "cpu_s": cpu, "s_per_step": cpu / len(rows),
            "wall_per_step": wall / len(rows), "student_share": student / len(rows), **busy}


def final_figures(report: dict) -> dict:
    """The figures of an `evaluate_checkpoint(..., with_kl=True)` report."""
    m, q = report["metrics"], report["quality"]
    return {"fid": m["fid"], "precision": m["precision"], "recall": m["recall"],
            "isc": m["isc"], "class_acc": m.get("class_acc"), "kl_data": q["kl_data"],
            "kl_samples": q["kl_samples"], "exposure_gap": q["kl_samples"] - q["kl_data"]}


Runner = Callable[[RunConfig, Path], list]


def run_arm(b: SchedulesBench, arm: str, seed: int, steps: int, out: Path,
            log: Callable[[str], None] = print, runner: Runner | None = None) -> dict:
    """Train (arm, seed) for `steps` steps in OUT/<arm>/seed<seed>/ and evaluate its final
    student; returns (and writes to result.json) its figures.  A finished run with the same
    spec is read back instead (b.reuse); an unfinished one is started again."""
    from opd.eval.run import evaluate_checkpoint
    from opd.run.preflight import check_inputs
    from opd.run.reference import run_reference

    run_dir = out / arm / f"seed{seed}"
    cfg = arm_config(b, arm, seed, steps, run_dir)
    spec = run_spec(b, arm, seed, steps, cfg)
    result_file = run_dir / RESULT_FILE
    if b.reuse and result_file.is_file():
        done = json.loads(result_file.read_text())
        if done.get("spec") == spec:
            log(f"schedules: {arm} seed {seed}: reusing {run_dir}")
            return done
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} holds files but no config.yaml of a bench run; "
                              f"pass another --out or move them")
        shutil.rmtree(run_dir)             # an unfinished run of this bench, or another spec
    check_inputs(cfg)
    save_config(cfg, run_dir / "config.yaml")
    log(f"schedules: {arm} seed {seed}: {steps} steps in {run_dir}")
    t0 = time.perf_counter()
    if runner is None:
        if b.mode != "reference":
            raise ConfigError(f"bench preset key mode={b.mode!r}: needs a runner "
                              f"(`opd bench schedules` passes the Ray pipeline)", "mode")
        run_reference(cfg, run_dir, progress=False)
    else:
        runner(cfg, run_dir)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = evaluate_checkpoint(run_dir, out_dir=run_dir / FINAL_DIR,
                                 num_samples=b.final_samples, with_kl=True,
                                 kl_rows=b.final_kl_rows)
    result = {"arm": arm, "seed": seed, "run_dir": str(run_dir), "spec": spec,
              **run_figures(run_dir), **final_figures(report),
              "num_samples": report["num_samples"], "train_process_s": train_s,
              "final_eval_s": time.perf_counter() - t0}
    result_file.write_text(json.dumps(result, indent=1) + "\n")
    log(f"schedules: {arm} seed {seed}: FID {result['fid']:.1f}, class acc "
        f"{result['class_acc']:.3f}, KL data {result['kl_data']:.4f}, on-policy "
        f"{result['kl_samples']:.4f}, {result['wall_s']:.0f} s")
    return result


def equal_time_steps(match_wall_s: float, base_s_per_step: float) -> int:
    """Steps of the base arm that take the matched arm's distillation time (at least 1)."""
    return max(1, int(round(match_wall_s / base_s_per_step)))


# ---- the bench -------------------------------------------------------------------------------

def run_schedules(b: SchedulesBench, out: str | Path,
                  log: Callable[[str], None] = print, runner: Runner | None = None) -> dict:
    """Every (arm, seed), then every equal-time arm per seed; returns the report that
    schedules.json holds: the preset, every run's figures, the summary per arm.  `runner`
    (cfg, run_dir) trains a run in ray mode (opd imports no actors)."""
    out = Path(out)
    timed = [a for a in b.equal_time if b.only is None or a in b.only]
    need = {a for a in b.arms if b.only is None or a in b.only}
    need |= {b.equal_time[a][k] for a in timed for k in ("base", "match")}
    arms = [a for a in b.arms if a in need]
    runs, done = [], {}
    for seed in b.seeds:
        done[seed] = {arm: run_arm(b, arm, seed, b.steps, out, log, runner) for arm in arms}
        runs += done[seed].values()
    for arm in timed:
        spec = b.equal_time[arm]
        clock = ("cpu_s", "s_per_step") if b.mode == "reference" else ("wall_s", "wall_per_step")
        per_seed = [equal_time_steps(done[s][spec["match"]][clock[0]],
                                     done[s][spec["base"]][clock[1]]) for s in b.seeds]
        steps = int(round(float(np.median(per_seed))))
        log(f"schedules: {arm}: the {spec['base']} steps that fit {spec['match']}'s "
            f"{'CPU' if b.mode == 'reference' else 'wall'} time, "
            f"per seed: {per_seed}; the median, {steps}, for every seed")
        for seed in b.seeds:
            base, match = done[seed][spec["base"]], done[seed][spec["match"]]
            r = run_arm(b, arm, seed, steps, out, log, runner)
            r["equal_time"] = {"base": base["arm"], "match": match["arm"],
                               "match_cpu_s": match["cpu_s"], "match_wall_s": match["wall_s"],
                               "base_s_per_step": base["s_per_step"],
                               "per_seed_steps": per_seed}
            runs.append(r)
    report = {"bench": asdict(b), "runs": runs, "summary": summarize(runs, [*arms, *timed]),
              "environment": common.environment("cpu")}
    report["curves"] = curve_figures(report)
    return report


def mean_sd(values: list[float]) -> dict:
    """mean, sample sd (ddof 1; 0 for one value) and n of the finite values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "n": int(len(v))}


def summarize(runs: list[dict], arms: list[str]) -> dict:
    """{arm: {metric: mean_sd over its seeds}} for every METRICS entry, in `arms` order."""
    return {arm: {k: mean_sd([r.get(k) for r in runs if r["arm"] == arm]) for k in METRICS}
            for arm in arms}


__all__ = ["SchedulesBench", "load_schedules_bench", "run_schedules", "run_arm", "summarize",
           "mean_sd", "equal_time_steps", "run_figures"]
