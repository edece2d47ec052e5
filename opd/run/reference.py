"""The single-process reference OPD loop: the algorithm every distributed run is checked against.

Per step k (policy version k = the number of updates the student has had):

    batch  = next prefix batch from the Parquet data           (real prefix, ratio · T; the ratio
                                                               is data.prefix_ratio or one of
                                                               data.prefix_ratios, by batch id)
    phase  = phase_at(cfg, k)                                  (distill.phases: the step's
                                                               objective, λ, prefix ratios, lr)
    source = objective.choose_source(k, seed)                  (GKD's λ: student or data)
    for part in parts(batch):                                  (rollout calls, opd/distill/pieces.py)
        for piece in generate(current student, engine, part):  (each piece as its rows complete,
                                                               opd/distill/stream.py; eval mode,
                                                               no label dropout)
            piece = score(teacher, piece)                      (teacher log-probs, full or top-k)
    learn(student, optimizer, pieces, objective)               (gradients accumulated over the
                                                               pieces in order, one update; loss
                                                               on the generated suffix; the
                                                               on-policy check, opd/distill/onpolicy.py,
                                                               on the same forward's logits)

Deterministic for a seed: batches come from a seeded order, rollout random numbers are keyed
by (seed, batch id, image, position, attempt), and the loop itself draws nothing.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from opd.run import checkpoints as ckpt
from opd.run.interrupt import GracefulInterrupt, NoInterrupt
from opd.models import precision
from opd.run.artifacts import plot_training
from opd.config.schema import RunConfig
from opd.data import PrefixBatcher
from opd.eval.tracking import Evaluator, has_row, is_eval_step, quality_log
from opd.run.loop import (StepLog, check_objectives,
                      step_row)
from opd.models import load_into, load_state_dict_safely
from opd.models.factory import load_role_model
from opd.data.splits import open_dataset
from opd.distill.phases import objectives, phase_at, rolls_out
from opd.distill.pieces import merge_batches, step_layout
from opd.distill.plan import step_jobs, step_source
from opd.distill.reuse import ReuseSchedule, check_resume
from opd.distill.score_cache import DataScoreCache
from opd.distill.rollout_stats import RolloutStats
from opd.distill.ensemble import TeacherEnsemble, load_teachers
from opd.distill.teachers import run_teachers, score_piece, teacher_metrics
from opd.distill.steps import build_engine, learn, make_optimizer, needs_teacher_scores, score
from opd.distill.span_scoring import PartScoring
from opd.distill.stream import Piece, PartStream
from opd.distill.phases import learning_rate
from rollout.spans import Span


def _teacher_rollouts(cfg: RunConfig) -> bool:
    """Whether some phase samples its sequences from the teacher (SeqKD)."""
    return any(o.source == "teacher" for o in objectives(cfg))


def save_checkpoint(run_dir: Path, step: int, student, optimizer, batcher: PrefixBatcher,
                    cfg: RunConfig) -> Path:
    """checkpoints/step_<n>/ (opd/run/checkpoints.py): student.pt, optimizer/optimizer.pt (torch)
    and state.json (mode "reference"); returns its path.  CheckpointWriteError if the disk
    refuses it (the partial step_<n>.tmp is removed, earlier checkpoints stay)."""
    with ckpt.writing(run_dir, step) as tmp:
        ckpt.write_student(tmp, student.state_dict())
        ckpt.save_torch(optimizer.state_dict(), tmp / ckpt.OPTIMIZER_DIR / ckpt.TORCH_OPTIMIZER_FILE)
        return ckpt.commit(tmp, ckpt.checkpoint_state(cfg, step, batcher.state_dict(), "reference"))


def load_checkpoint(path: Path, student, optimizer, batcher: PrefixBatcher) -> int:
    """Restore the student, the optimizer and the data cursor; returns the next step."""
    state = ckpt.read_state(path, mode="reference")
    load_into(student, load_state_dict_safely(path / ckpt.STUDENT_FILE), str(path))
    optimizer.load_state_dict(torch.load(path / ckpt.OPTIMIZER_DIR / ckpt.TORCH_OPTIMIZER_FILE,
                                         map_location="cpu", weights_only=True))
    batcher.load_state_dict(state["data"])
    return int(state["step"])


def track_quality(evaluator: Evaluator | None, quality, student, step: int, run_dir: Path) -> None:
    """Evaluate the student as the weights of `step` when it is an evaluation step without a
    row yet (opd/eval/tracking.py: a copy is measured, the training state is left alone)."""
    if (evaluator is None or not is_eval_step(evaluator.cfg, step)
            or has_row(quality.rows, "student", step)):
        return
    evaluator.load(student.state_dict())
    quality.append(evaluator.student_row(step, run_dir))


def make_batch(cfg: RunConfig, step: int, pb, source: str, objective, layout, seq_len: int,
               model, engine, scorers, cache: DataScoreCache | None = None
               ) -> tuple[list, list, list, dict, float]:
    """Step `step`'s pieces of prefix batch `pb`, generated by `model` (the student at version
    `step`, or the teacher) and scored by `scorers` (teacher models, the run config, the
    `Teachers`) when the objective needs it, a data piece through `cache` when given
    (distill.cache_data_scores): (scored pieces in piece order, each rollout call's stats, the
    teachers' share measures, {"rollout", "teacher"} seconds, the teacher seconds spent while a
    rollout call still decoded).  With rollout.span a call's spans are scored as they come
    (opd/distill/span_scoring.py) and its pieces once it is complete; without, each piece is
    scored as it comes.  A span that went out while the call still had rounds to run
    (`Span.midway`: every span but the last of a Jacobi call; none of Cached AR's, which come
    at its end) is scored while the rollout could run beside it."""
    seconds = {"rollout": 0.0, "teacher": 0.0}
    scored, part_stats, measures, in_rollout = [], [], [], 0.0
    scores = needs_teacher_scores(objective)

    def score_one(c: int, piece: Piece):
        if cache is not None and source == "data":
            rows = pb.rows[layout.call_rows[c].numpy()][piece.rows.numpy()]
            return cache.score(rows, piece.batch, lambda b: score_piece(*scorers, b, score))
        return score_piece(*scorers, piece.batch, score)

    for c, job in enumerate(step_jobs(cfg, step, source, pb, seq_len, layout)):
        span = cfg.rollout.span if scores and job.source != "data" else 0
        stream = PartStream(model, engine, job, cfg, step, layout.part_sizes(c), span)
        spans = PartScoring(*scorers, job) if span else None
        pieces = []
        t0 = time.perf_counter()
        for item in stream:                            # spans in order, pieces as they complete
            seconds["rollout"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if isinstance(item, Span):
                spans.score(item)
                if item.midway:                        # the call had rounds left to run
                    in_rollout += time.perf_counter() - t0
            elif scores and spans is None:
                batch, piece_shares = score_one(c, item)
                measures += [s.measure() for s in piece_shares]
                item = Piece(item.index, item.rows, batch)
            if scores:
                seconds["teacher"] += time.perf_counter() - t0
            if isinstance(item, Piece):
                pieces.append(item)
            t0 = time.perf_counter()
        seconds["rollout"] += time.perf_counter() - t0
        part_stats.append(stream.stats)
        for piece in sorted(pieces, key=lambda p: p.index):   # the learner sums in piece order
            if spans is not None:
                t0 = time.perf_counter()
                batch, piece_shares = spans.piece(piece.rows, piece.batch)
                measures += [s.measure() for s in piece_shares]
                piece = Piece(piece.index, piece.rows, batch)
                seconds["teacher"] += time.perf_counter() - t0
            scored.append(piece.batch)
    return scored, part_stats, measures, seconds, in_rollout


def run_reference(cfg: RunConfig, run_dir: str | Path, *, progress: bool = True,
                  resume: bool = False, stop_after: int | None = None,
                  interrupt: GracefulInterrupt | None = None) -> list[dict]:
    """Run cfg.distill.steps OPD steps in this process; returns the per-step metric rows (also
    in run_dir/metrics.parquet).  `resume` continues from the run's latest checkpoint;
    `stop_after` ends the loop early after that many steps (tests of exact resume); `interrupt`
    (opd.run.interrupt.GracefulInterrupt), asked before every step: after Ctrl-C, checkpoint that
    step and raise RunInterrupted."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    interrupt = interrupt or NoInterrupt()
    seed = cfg.run.seed
    torch.manual_seed(seed)
    teachers = run_teachers(cfg)
    tmodels = load_teachers(cfg, progress=progress)
    teacher = tmodels[0]              # SeqKD's (one teacher: the config refuses several)
    student = load_role_model(cfg, "student", progress=progress)
    policy = precision.RolloutCopy(cfg, student)          # the student in model.dtype
    autocast = precision.learner_autocast(cfg, next(student.parameters()).device)
    check_objectives(cfg)
    engine = build_engine(cfg) if rolls_out(cfg) or _teacher_rollouts(cfg) else None
    train = open_dataset(cfg, "train")
    batcher = PrefixBatcher(train, cfg.data.batch_size, seed)
    optimizer = make_optimizer(student, cfg)
    layouts = {src: step_layout(cfg, src) for src in ("student", "teacher", "data")}
    start = 0
    if resume:
        last = ckpt.latest_checkpoint(run_dir)
        if last is not None:
            start = load_checkpoint(last, student, optimizer, batcher)
    schedule = ReuseSchedule(cfg)                  # rollout reuse: which rollout a step trains on
    check_resume(schedule, start)
    buffer: dict[int, list] = {}                   # step -> its scored pieces, while buffered
    cache = DataScoreCache() if cfg.distill.cache_data_scores else None
    steps = StepLog(cfg, run_dir, start=start, stop_after=stop_after, resume=resume,
                    desc="opd reference", progress=progress)
    quality = quality_log(run_dir, resume=resume, start=start)
    steps.follow(quality)
    evaluator = (Evaluator(cfg, TeacherEnsemble(teachers, tmodels).eval()) if cfg.eval.track
                 else None)
    if evaluator is not None and not has_row(quality.rows, "teacher"):
        quality.append(evaluator.teacher_row(run_dir))
    track_quality(evaluator, quality, student, start, run_dir)
    with steps:
        for step in range(start, steps.end):
            if interrupt.check():
                path = save_checkpoint(run_dir, step, student, optimizer, batcher, cfg)
                raise steps.interrupted(step, path)
            objective, source = step_source(cfg, step)
            layout = layouts[source]
            cpu0 = time.process_time()
            if schedule.reused(step):                 # a buffered rollout: no batch, no scoring
                scored, part_stats, measures = buffer[schedule.origin(step)], [], []
                seconds, in_rollout = {"rollout": 0.0, "teacher": 0.0}, 0.0
            else:
                scored, part_stats, measures, seconds, in_rollout = make_batch(
                    cfg, step, next(batcher), source, objective, layout, train.seq_len,
                    teacher if source == "teacher" else policy(student), engine,
                    (tmodels, cfg, teachers), cache)
                buffer[step] = scored
            t0 = time.perf_counter()
            metrics = learn(student, optimizer, scored, objective, grad_clip=cfg.learner.grad_clip,
                            dropout=cfg.learner.student_dropout, lr=learning_rate(cfg, step),
                            check=cfg, autocast=autocast)  # on-policy check: version `step`,
            #                                                 before the update
            seconds["learner"] = time.perf_counter() - t0
            traj = merge_batches(scored)
            traj.rollout_stats = (RolloutStats.merge(part_stats) if part_stats  # the calls' own
                                  else RolloutStats())                       # (none: reused)
            buffer = {s: buffer[s] for s in schedule.kept(step)}
            row = step_row(step, traj, metrics, seconds, phase=phase_at(cfg, step).name,
                           reused=schedule.reused(step))
            row["pieces"] = layout.pieces
            row.update(teacher_metrics(teachers, measures))
            if cache is not None:
                row["score_cache_images"], row["score_cache_bytes"] = len(cache), cache.nbytes
            row["teacher_in_rollout_s"] = in_rollout           # rollout.span: scored early
            row["step_cpu_s"] = time.process_time() - cpu0     # this process's CPU: not the load
            steps.record(row)                                  # other processes put on the machine
            track_quality(evaluator, quality, student, step + 1, run_dir)
            if steps.checkpoint_due(step + 1):
                save_checkpoint(run_dir, step + 1, student, optimizer, batcher, cfg)
                plot_training(steps.rows, run_dir / "training.png", quality=quality.rows)
        return steps.close()
