"""`TrajectoryQueue`: the connection between the workers that deliver a step's trajectory pieces
and the learner ranks that train on them.

Workers put each piece they deliver (actors/transport/delivery.py: one object-store object per
learner rank, the piece's rows that rank trains on; the worker that delivered them owns them)
with `put_piece(step, gen, piece, refs)`.  The driver, once every piece of a step has been
reported delivered, `seal`s the step into one item (its batch id, policy version, samples and
generated tokens); learner rank r then `take`s the item's rank-r refs for its step and fetches
only its own rows.  The queue holds refs only (kept in lists, so Ray passes them through
instead of resolving them): no trajectory passes through it or through the driver.

- No bound of its own: the driver plans a step only `distill.queue_capacity` steps ahead of the
  learner (actors/driver/planner.py), so at most that many steps are ever sealed and not
  trained.  The bound sits where work starts, not here: a refused seal would hold pieces that
  were already made.
- Strict on-policy (staleness 0): an item is handed out only at exactly the version that
  generated it.  Bounded staleness k: lag = learner_version − version in [0, k]; the lag of
  every sample handed out is counted (a histogram {lag: samples}).  Items that became too old
  are never handed out: they are dropped and counted (`counts["expired"]`), and a `take` of
  their step answers None.
- Generations: a step re-planned by the driver gets a new generation `gen`; sealing keeps the
  pieces of the sealed generation only, and pieces of steps already handed out are dropped.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field



@dataclass
class QueueItem:
    step: int                 # learner step that consumes it
    batch_id: int
    version: int              # policy version that generated it
    refs: list = field(default_factory=list)   # refs[rank][piece]: ObjectRef
    samples: int = 0          # sequences (rows) in the batch
    generated_tokens: int = 0  # generated (loss) tokens of the whole batch


class QueueCore:
    """The queue's bookkeeping of sealed items (no Ray, no waiting)."""

    def __init__(self, staleness: int = 0):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self.items: list[QueueItem] = []
        self.lags: Counter[int] = Counter()  # {lag: samples handed out with that lag}
        self.counts = {"put": 0, "handed_out": 0, "expired": 0}

    def put(self, item: QueueItem) -> None:
        self.items.append(item)
        self.counts["put"] += 1

    def admissible(self, version: int, learner_version: int) -> bool:
        """Would a trajectory of policy `version` be consumed at `learner_version`?"""
        return 0 <= learner_version - version <= self.staleness

    def get(self, learner_version: int, step: int | None = None) -> QueueItem | None:
        """Pop the admissible item with the lowest step (or exactly `step`), else None.  Items
        too old for `learner_version` are dropped (counted as expired) first."""
        for item in [i for i in self.items if learner_version - i.version > self.staleness]:
            self.items.remove(item)
            self.counts["expired"] += 1
        ready = [i for i in self.items if self.admissible(i.version, learner_version)
                 and (step is None or i.step == step)]
        if not ready:
            return None
        item = min(ready, key=lambda i: i.step)
        self.items.remove(item)
        self.lags[learner_version - item.version] += max(1, item.samples)
        self.counts["handed_out"] += 1
        return item

    def stats(self) -> dict:
        return {"depth": len(self.items), "staleness": self.staleness,
                "max_lag": max(self.lags, default=0), "samples": sum(self.lags.values()),
                **self.counts}


class PieceStore:
    """Delivered pieces of steps not sealed yet: {step: {gen: {piece: {teacher: refs by rank}}}}
    (each teacher's share of the piece, its scores of its rows, opd/distill/teachers.py; an
    unscored piece: teacher 0), and the policy version of each (step, gen).  A rank's refs of a
    piece are its shares' refs, in teacher order."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.pieces: dict[int, dict[int, dict[int, dict[int, list]]]] = {}
        self.versions: dict[tuple[int, int], int] = {}
        self.handed_out_below = 0          # steps < this were handed out: late pieces are dropped
        self.dropped = 0

    def put(self, step: int, gen: int, piece: int, refs: list, version: int = -1,
            teacher: int = 0) -> bool:
        if step < self.handed_out_below or len(refs) != self.world_size:
            self.dropped += 1
            return False
        self.pieces.setdefault(step, {}).setdefault(gen, {}).setdefault(piece, {})[teacher] = list(refs)
        self.versions[step, gen] = version
        return True

    def get(self, step: int, gen: int, piece: int) -> tuple[list, int] | None:
        """(each rank's refs of the piece's shares, in teacher order; version) of a delivered
        piece not sealed yet (its latest delivery of each share)."""
        shares = self.pieces.get(step, {}).get(gen, {}).get(piece)
        return None if shares is None else (self._by_rank(shares), self.versions[step, gen])

    def _by_rank(self, shares: dict[int, list]) -> list[list]:
        """Each rank's cut of a piece: its ref of each share ({teacher: refs by rank}), in
        teacher order."""
        return [[shares[t][r] for t in sorted(shares)] for r in range(self.world_size)]

    def forget(self, step: int) -> None:
        self.pieces.pop(step, None)
        for key in [k for k in self.versions if k[0] == step]:
            del self.versions[key]

    def seal(self, step: int, gen: int, pieces: int) -> list[list]:
        """refs[rank][piece] of generation `gen` of `step` (the step's other generations are
        dropped); KeyError naming what is missing."""
        have = self.pieces.get(step, {}).get(gen, {})
        missing = [p for p in range(pieces) if p not in have]
        if missing:
            raise KeyError(f"step {step} generation {gen}: pieces {missing} were not delivered")
        self.forget(step)
        by_rank = [self._by_rank(have[p]) for p in range(pieces)]
        return [[by_rank[p][r] for p in range(pieces)] for r in range(self.world_size)]


class TrajectoryQueue:
    """The queue as an async Ray actor (wrapped by `ray.remote` in actors/driver/cluster.py)."""

    def __init__(self, staleness: int = 0, world_size: int = 1):
        self.core = QueueCore(staleness)
        self.store = PieceStore(world_size)
        self.taking: dict[int, tuple[QueueItem, set[int]]] = {}   # step -> item, ranks that took it
        self.version: int | None = None      # the learner version of the last `take`

    def __repr__(self) -> str:
        return (f"TrajectoryQueue(opd/queue, version={self.version}, "
                f"depth={len(self.core.items)})")

    async def info(self) -> dict:
        return {"role": "queue", "version": self.version, "repr": repr(self)}

    async def put_piece(self, step: int, gen: int, piece: int, refs: list,
                        version: int = -1, teacher: int = 0) -> bool:
        """A worker delivers piece `piece` of `step` (generation `gen`, policy `version`), or
        teacher `teacher`'s share of it: one ref per learner rank.  False: dropped (its step was
        handed out)."""
        return self.store.put(step, gen, piece, refs, version, teacher)

    async def take_piece(self, step: int, gen: int, piece: int, rank: int,
                         learner_version: int) -> dict | None:
        """Learner rank `rank`'s refs (one per share) of piece `piece` of a streaming step (docs/STREAMING.md),
        delivered and not necessarily sealed: its latest delivery, else the sealed item's.  None
        if it is not there or not admissible at `learner_version` (strict: its own version
        only).  The step leaves the queue when every rank `take`s it after its last piece."""
        found = self.store.get(step, gen, piece)
        if found is None:
            item = next((i for i in self.core.items if i.step == step), None)
            if item is None:
                return None
            found = ([refs[piece] for refs in item.refs], item.version)
        refs, version = found
        if not self.core.admissible(version, learner_version):
            return None
        return {"refs": refs[rank], "depth": len(self.core.items)}

    async def seal(self, item: QueueItem, gen: int, pieces: int) -> None:
        """Make the delivered pieces of `item.step` (generation `gen`) one item."""
        item.refs = self.store.seal(item.step, gen, pieces)
        self.core.put(item)

    async def take(self, step: int, learner_version: int, rank: int) -> dict | None:
        """Learner rank `rank`'s rows of the item of `step` at `learner_version`: its refs (one
        per piece, each its shares' refs) and the batch's totals; None if no admissible item."""
        self.version = learner_version
        if step not in self.taking:
            item = self.core.get(learner_version, step)
            if item is None:
                return None
            self.taking[step] = (item, set())
            self.store.handed_out_below = max(self.store.handed_out_below, step + 1)
        item, took = self.taking[step]
        took.add(rank)
        if len(took) == self.store.world_size:
            del self.taking[step]
            self.store.forget(step)              # pieces delivered again after the seal
        return {"step": item.step, "batch_id": item.batch_id, "version": item.version,
                "refs": list(item.refs[rank]), "samples": item.samples,
                "generated_tokens": item.generated_tokens, "depth": len(self.core.items)}

    async def drop(self, step: int) -> None:
        """Forget a step's item after a learner rank could not fetch its rows (a worker that
        owned them died): the driver makes the step's pieces again and seals them anew."""
        self.taking.pop(step, None)
        self.store.handed_out_below = min(self.store.handed_out_below, step)

    async def lags(self) -> dict[int, int]:
        """{lag: samples}: how many samples were handed out with each policy lag."""
        return dict(sorted(self.core.lags.items()))

    async def stats(self) -> dict:
        return {**self.core.stats(), "dropped_pieces": self.store.dropped}
