"""Rollout reuse: which student rollout each step trains on (DESIGN.md invariant 6; DistiLLM's
replay buffer, arXiv 2402.03898).

With a phase's `reuse` k > 1, a student rollout, with its teacher's scores, may train up to k
updates.  The last `reuse_buffer` N rollouts made are buffered; a student step (GKD's λ chose
the student) makes a fresh rollout with probability `reuse_fresh`, or when nothing buffered can
be reused, else it trains on a rollout drawn uniformly from the buffer.  The learner recomputes
the current student's distribution on the stored tokens, so the divergence at the stored
positions is exact; only the visited states lag, by the versions between the rollout's policy
and the update's: at most k · N (`max_lag`).  A buffered rollout leaves the buffer once it has
trained k updates, once N newer rollouts are in, once it is older than `max_lag`, or at the end
of its phase.  reuse 1 buffers nothing: every step is the strict run's.

Every choice is keyed by (run.seed, step), so the reference loop, the Ray driver and every
learner rank agree on it without talking, also after a resume:

    schedule = ReuseSchedule(cfg)
    schedule.origin(step)     # the step whose rollout `step` trains on (== step: a fresh one)
    schedule.kept(step)       # the steps whose rollouts are buffered once `step` trained
"""
from __future__ import annotations

from dataclasses import dataclass

from opd.config.loader import ConfigError
from opd.config.schema import RunConfig
from opd.distill.phases import Phase, phase_at, phases
from opd.distill.plan import step_source
from opd.distill.steps import keyed_seed

FRESH_KEY = 0x5246      # keyed_seed's third key for "fresh or buffered?" ("RF")
PICK_KEY = 0x5250       # and for which buffered rollout ("RP")


def max_lag(phase: Phase) -> int:
    """The largest policy lag a reused rollout of `phase` trains at: reuse · reuse_buffer."""
    return phase.reuse * phase.reuse_buffer


def uniform(*keys: int) -> float:
    """A number in [0, 1) keyed by integers (`keyed_seed`), independent of call order."""
    return keyed_seed(*keys) / 2 ** 62


@dataclass
class Buffered:
    """A buffered rollout: the step that made it, its phase, the updates it trained so far."""
    origin: int
    phase: int
    uses: int = 1


class ReuseSchedule:
    """The run's draws, simulated step by step from step 0 (integers only: cheap) and kept."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.active = any(p.reuse > 1 for p in phases(cfg))   # else nothing to simulate
        self.buffer: list[Buffered] = []
        self.origins: list[int] = []             # step -> the step whose rollout it trains on
        self.kepts: list[tuple[int, ...]] = []   # step -> buffered once it trained

    def origin(self, step: int) -> int:
        if not self.active:
            return step
        self._advance(step)
        return self.origins[step]

    def reused(self, step: int) -> bool:
        """Whether `step` trains on a buffered rollout (not a prefix batch of its own)."""
        return self.origin(step) != step

    def kept(self, step: int) -> tuple[int, ...]:
        if not self.active:
            return ()
        self._advance(step)
        return self.kepts[step]

    def _advance(self, step: int) -> None:
        while len(self.origins) <= step:
            t = len(self.origins)
            self.origins.append(self._draw(t))
            self.kepts.append(tuple(b.origin for b in self.buffer))

    def _draw(self, t: int) -> int:
        p = phase_at(self.cfg, t)
        self.buffer = [b for b in self.buffer
                       if b.phase == p.index and b.uses < p.reuse and t - b.origin <= max_lag(p)]
        if p.reuse == 1 or step_source(self.cfg, t)[1] != "student":
            return t
        seed = self.cfg.run.seed
        if self.buffer and uniform(seed, t, FRESH_KEY) >= p.reuse_fresh:
            b = self.buffer[keyed_seed(seed, t, PICK_KEY) % len(self.buffer)]
            b.uses += 1
            self.buffer = [b for b in self.buffer if b.uses < p.reuse]
            return b.origin
        self.buffer = [*self.buffer, Buffered(t, p.index)][-p.reuse_buffer:]
        return t


def check_resume(schedule: ReuseSchedule, start: int) -> None:
    """A run resumed at `start` must find the reuse buffer empty: buffered rollouts are not in a
    checkpoint (their policy's weights are gone), so the resumed run could not train on them:
    a ConfigError (one line from the `opd` command)."""
    kept = schedule.kept(start - 1) if start > 0 else ()
    if kept:
        raise ConfigError(f"cannot resume at step {start}: the rollouts of steps {list(kept)} are in "
                           f"the reuse buffer (distill.reuse > 1) and not in the checkpoint; "
                           f"resume from a checkpoint where the buffer is empty, or start again",
                          "distill.reuse")
