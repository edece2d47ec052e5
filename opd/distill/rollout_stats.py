"""`RolloutStats`: what one rollout call tells about itself (rounds, committed tokens, seconds,
histograms); it travels in `TrajectoryBatch.rollout_stats` and a worker's `PartReport`, and the
stats of a step's rollout calls, generated side by side, are put together by
`RolloutStats.merge`.  Every field declares its merge rule next to it (`stat(default, RULE)`);
`check_rules` refuses a record with a field that has none, so a new field cannot be merged by
accident.  `row()` gives the metrics.parquet columns (opd/run/loop.py `step_row`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable


COMMIT_HIST_WIDTH = 16
"""Entries of a rollout's committed-tokens histogram (metrics.parquet `commit_hist`: entry k
counts image-rounds that committed k + 1 tokens; 16 or more land in the last entry)."""
WINDOW_HIST_WIDTH = 16   # `window_hist`: verifier rounds by window W (entry W - 1)

Rule = Callable[[list, list], Any]   # (the field's values in part order, the parts) -> merged


def SUM(values: list, parts: list) -> Any:
    """Counts of the parts add up."""
    return sum(values)


def MAX(values: list, parts: list) -> Any:
    """Rounds, seconds, the longest stall: the slowest part's (the parts run side by side)."""
    return max(values)


def FIRST(values: list, parts: list) -> Any:
    """The same in every part (the engine's name)."""
    return values[0]


def ADD_ENTRIES(values: list, parts: list) -> list[int] | None:
    """Histograms add entry by entry (None: no part has one, e.g. a step on data)."""
    present = [v for v in values if v is not None]
    return [sum(col) for col in zip(*present)] if present else None


def CONCAT(values: list, parts: list) -> list:
    """Per-image lists, in part order."""
    return [x for v in values for x in v]


def COMMITTED_MEAN(values: list, parts: list) -> float:
    """Tokens committed per image-round, re-weighted by each part's image-rounds
    (generated_tokens / mean_committed); 0.0 when no part committed any."""
    image_rounds = sum(p.generated_tokens / p.mean_committed for p in parts
                       if p.mean_committed > 0)
    return sum(p.generated_tokens for p in parts) / image_rounds if image_rounds > 0 else 0.0


RULES = (SUM, MAX, FIRST, ADD_ENTRIES, CONCAT, COMMITTED_MEAN)


def stat(default, rule: Rule):
    """A record field with its merge rule (a list default is copied per record)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"merge": rule})
    return field(default=default, metadata={"merge": rule})


def check_rules(cls) -> type:
    """`cls` (a dataclass) with every field's merge rule one of RULES; TypeError naming the
    field otherwise."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("merge") not in RULES:
            raise TypeError(f"{cls.__name__}.{f.name} has no merge rule: declare it with "
                            f"stat(default, rule), rule one of {[r.__name__ for r in RULES]}")
    return cls


@check_rules
@dataclass
class RolloutStats:
    """Statistics of one rollout call (or, merged, of a step's calls).  A step on data runs no
    rollout: every field keeps its default."""
    rollout_seconds: float = stat(0.0, MAX)   # the engine's wall time of the call
    ar_seconds: float = stat(0.0, MAX)        # the call's wall time where Cached AR ran it
    #                                           in the engine's place (rollout.compare_every)
    cpu_seconds: float = stat(0.0, MAX)       # the call's CPU seconds (a one-thread CPU
    #                                           rollout: `RolloutResult.cpu_time`), else 0
    rounds: int = stat(0, MAX)                # sequential verifier forwards (prefill included)
    ar_rounds: int = stat(0, MAX)             # the rounds Cached AR needs for the same tokens
    mean_committed: float = stat(0.0, COMMITTED_MEAN)   # tokens per image per active round
    engine: str = stat("", FIRST)
    generated_tokens: int = stat(0, SUM)      # B · N
    accepted: int = stat(0, SUM)              # drafts accepted and committed
    rejected: int = stat(0, SUM)
    commit_hist: list[int] | None = stat(None, ADD_ENTRIES)   # (COMMIT_HIST_WIDTH,) image-rounds
    window_hist: list[int] | None = stat(None, ADD_ENTRIES)   # (WINDOW_HIST_WIDTH,) rounds by W
    image_rounds: list[int] = stat([], CONCAT)  # (B,) rounds each image was active in
    image_rounds_max: int = stat(0, MAX)
    image_rounds_sum: int = stat(0, SUM)
    images: int = stat(0, SUM)
    longest_single_run: int = stat(0, MAX)    # the longest stall (rounds committing one token)
    teacher_seconds: float = stat(0.0, MAX)   # set by `opd.distill.steps.score` on a scored piece

    @classmethod
    def of(cls, result, ar_rounds: int) -> RolloutStats:
        """The stats of a `rollout.stats.RolloutResult`; `ar_rounds` as the field."""
        image_rounds = result.image_rounds
        return cls(rollout_seconds=result.wall_time, cpu_seconds=result.cpu_time or 0.0,
                   rounds=result.rounds, ar_rounds=ar_rounds,
                   mean_committed=result.mean_committed, engine=result.engine,
                   generated_tokens=result.num_new_tokens * result.tokens.shape[0],
                   accepted=int(result.accepted.sum()), rejected=int(result.rejected.sum()),
                   commit_hist=result.commit_histogram(COMMIT_HIST_WIDTH),
                   window_hist=result.window_histogram(WINDOW_HIST_WIDTH),
                   image_rounds=image_rounds.tolist(), image_rounds_max=int(image_rounds.max()),
                   image_rounds_sum=int(image_rounds.sum()), images=int(image_rounds.numel()),
                   longest_single_run=int(result.longest_single_run.max()))

    @classmethod
    def merge(cls, parts: list[RolloutStats]) -> RolloutStats:
        """The stats of rollout calls generated side by side as the stats of their whole batch,
        each field by its rule."""
        if len(parts) == 1:
            return parts[0].copy()
        return cls(**{f.name: f.metadata["merge"]([getattr(p, f.name) for p in parts], parts)
                      for f in dataclasses.fields(cls)})

    def copy(self) -> RolloutStats:
        """A copy whose lists are its own."""
        return dataclasses.replace(self, **{k: list(v) for k, v in self.to_dict().items()
                                            if isinstance(v, list)})

    def to_dict(self) -> dict[str, Any]:
        """{field: value} of the fields that are set (a histogram of None is left out): plain
        Python, for the wire formats of `opd.distill.batch.TrajectoryBatch`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutStats:
        """Inverse of `to_dict`; a key that is not a field is a ValueError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"rollout_stats has unknown keys {unknown}; the fields are "
                             f"{sorted(names)} (opd/distill/records.py)")
        return cls(**d)

    def row(self) -> dict[str, Any]:
        """The metrics.parquet columns of the step these stats are of (after its other
        rollout columns; opd/run/loop.py `step_row`)."""
        return {"rounds": self.rounds, "ar_rounds": self.ar_rounds,
                "ar_rollout_s": self.ar_seconds,          # a call Cached AR ran, timed
                "engine_rollout_s": 0.0 if self.ar_seconds else self.rollout_seconds,  # the rest
                "ar_rollout_cpu_s": self.cpu_seconds if self.ar_seconds else 0.0,  # CPU seconds
                "engine_rollout_cpu_s": 0.0 if self.ar_seconds else self.cpu_seconds,
                "mean_committed": self.mean_committed,
                "commit_hist": self.commit_hist, "window_hist": self.window_hist,
                "image_rounds_max": self.image_rounds_max,
                "image_rounds_mean": self.image_rounds_sum / self.images if self.images else 0.0,
                "longest_single_run": self.longest_single_run}
