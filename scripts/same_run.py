"""Draw runs that train the same student side by side: loss, FID and class accuracy over the
steps (metrics.parquet and quality.parquet of each run directory), each run's wall time in its
legend.  README's picture of `opd train rollout.engine=cached_ar` against the default HB-SJD run
(the keyed sampler makes them one run, in different wall times: docs/ROLLOUTS.md):

    python scripts/same_run.py "Cached AR=runs/same/cached_ar:251" "HB-SJD=runs/same/hbsjd:210" \
        --out docs/images/same_run.png

Each argument is LABEL=RUN_DIR:SECONDS (the run's wall time, measured around `opd train`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd.run.metrics_log import read_metrics  # noqa: E402


def read_quality(run_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq
    path = run_dir / "quality.parquet"
    return pq.read_table(path).to_pylist() if path.is_file() else []


def draw(runs: list[tuple[str, Path, float]], out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    styles = [dict(lw=2.5, alpha=0.5), dict(lw=1, ls="--"), dict(lw=1, ls=":")]
    for (label, run_dir, seconds), style in zip(runs, styles):
        name = f"{label} ({seconds / 60:.1f} min)"
        rows = read_metrics(run_dir)
        axes[0].plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name, **style)
        students = sorted((q for q in read_quality(run_dir) if q["role"] == "student"),
                          key=lambda q: q["step"])
        for ax, key in ((axes[1], "fid"), (axes[2], "class_acc")):
            ax.plot([q["step"] for q in students], [q[key] for q in students], marker="o",
                    label=name, **style)
    axes[0].set(xlabel="step", ylabel="loss", title="distillation loss")
    axes[1].set(xlabel="step", ylabel="FID", title="student FID (1,000 samples)")
    axes[2].set(xlabel="step", ylabel="class accuracy", title="student class accuracy")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse(item: str) -> tuple[str, Path, float]:
    label, rest = item.split("=", 1)
    run_dir, seconds = rest.rsplit(":", 1)
    return label, Path(run_dir), float(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR:SECONDS")
    p.add_argument("--out", default="docs/images/same_run.png")
    args = p.parse_args(argv)
    print(draw([parse(r) for r in args.runs], Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
