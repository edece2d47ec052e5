"""`StepPlanner`: which step the driver plans next, with which prefix batch and policy version.

It owns the data cursor (the batcher's state before each planned step's batch, for
checkpoints), the plans of steps issued and not trained yet, and plan generations.  A step is
planned when the queue bound allows (`distill.queue_capacity` steps ahead of the learner) and,
for student rollouts, the staleness bound (`distill.staleness` versions behind the step).  The
queue bound is checked here only, where work starts: a step beyond it costs nothing yet, so at
most that many steps' pieces wait for the learner (the queue itself refuses nothing).  A step
that trains on a buffered rollout (opd/distill/reuse.py) draws no prefix batch: it is planned
once the step that made the rollout has trained, from that step's plan (kept in `buffer` while
the rollout is buffered; the learner ranks hold the rows).
"""
from __future__ import annotations

import itertools

from actors.driver.step import Step
from opd.config.schema import RunConfig
from opd.data import PrefixBatcher
from opd.distill.phases import phase_at
from opd.distill.pieces import step_layout
from opd.distill.plan import step_jobs, step_source
from opd.distill.reuse import ReuseSchedule, check_resume
from opd.distill.steps import needs_teacher_scores
from opd.distill.teachers import run_teachers


class StepPlanner:
    def __init__(self, cfg: RunConfig, batcher: PrefixBatcher, seq_len: int, start: int):
        self.cfg, self.batcher, self.seq_len = cfg, batcher, seq_len
        self.layouts = {src: step_layout(cfg, src) for src in ("student", "teacher", "data")}
        self.teachers = run_teachers(cfg)
        self.cursor = {start: batcher.state_dict()}   # data cursor before step s's batch
        self.plans: dict[int, Step] = {}
        self.reuse = ReuseSchedule(cfg)
        check_resume(self.reuse, start)
        self.buffer: dict[int, Step] = {}      # trained steps whose rollouts are buffered
        self.next_step = start
        self._gens = itertools.count()

    def plan(self, learner_version: int, published: int, end: int) -> Step | None:
        """The next step, cut into its parts and pieces, or None if a bound (or the end)
        holds it."""
        cfg, s = self.cfg, self.next_step
        if s >= end or s - learner_version >= cfg.distill.queue_capacity:
            return None
        objective, source = step_source(cfg, s)         # the same as the reference loop's
        if self.reuse.reused(s):
            origin = self.buffer.get(self.reuse.origin(s))
            if origin is None:                            # its rollout's step is not trained yet
                return None
            self.cursor[s + 1] = self.batcher.state_dict()
            step = self.plans[s] = Step.reusing(origin, s, gen=next(self._gens),
                                                schedule=phase_at(cfg, s).name)
            self.next_step += 1
            return step
        version = s
        if source == "student":
            version = published
            if s - version > cfg.distill.staleness:
                return None
        pb = next(self.batcher)
        lay = self.layouts[source]
        self.cursor[s + 1] = self.batcher.state_dict()
        step = self.plans[s] = Step(s, pb.batch_id, source, version,
                                    step_jobs(cfg, s, source, pb, self.seq_len, lay), lay,
                                    gen=next(self._gens), scored=needs_teacher_scores(objective),
                                    schedule=phase_at(cfg, s).name, teachers=self.teachers,
                                    span=cfg.rollout.span)
        self.next_step += 1
        return step

    def rollouts_at(self, version: int) -> bool:
        """Whether a fresh student rollout may be made with `version`'s weights: a step of
        [version, version + staleness + broadcast_every - 1] samples the student and does not
        reuse a buffered rollout.  Publishing only such versions changes no rollout's version
        (a step's is the latest one published, within its staleness), and spares a learner
        the serialisation of weights nobody loads: every KD warm-up step, every reused step."""
        d = self.cfg.distill
        last = min(version + d.staleness + d.broadcast_every, d.steps)
        return any(step_source(self.cfg, s)[1] == "student" and not self.reuse.reused(s)
                   for s in range(version, last))

    def new_generation(self) -> int:
        """A plan generation no answer in flight carries (a re-planned step's)."""
        return next(self._gens)

    def current(self, step: int, gen: int) -> Step | None:
        """Step `step` if `gen` is still its generation (else an answer to drop)."""
        plan = self.plans.get(step)
        return plan if plan is not None and plan.gen == gen else None

    def finish(self, step: int, version: int) -> Step:
        """Step `step` was trained; `version` is the learner's version now."""
        self.cursor = {s: c for s, c in self.cursor.items() if s >= version}
        plan = self.plans.pop(step)
        kept = self.reuse.kept(step)
        self.buffer = {s: plan if s == step else self.buffer[s] for s in kept}
        return plan
