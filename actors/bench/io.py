"""What a distributed run moves and holds, per step and per role: the Ray side of
`opd bench step` (launch/bench/step.py formats it; launch/bench/step_io.py).

    rows = run_with_io(cfg, run_dir)     # run_distributed's rows, each with "io" and "object_store"

Per learner step k (the window from the end of step k − 1 to the end of step k, which in strict
on-policy mode holds exactly one weight publish, rollout, scoring and update):

- row["io"][role] = {received_bytes, sent_bytes, peak_rss_bytes} for role in driver,
  rollout/<i>, teacher/<j>, learner/<r> (the trajectory queue holds refs only: no payload to
  count).  Actors count the array bytes of the payloads
  they receive and send (actors/transport/iostats.py, `io_stats()`); the driver counts the array bytes
  of everything `ray.get` returns to it while the run lasts (`DriverIO` wraps `ray.get`; the
  same `payload_nbytes` as the actors, not pickled sizes) and of what it `ray.put`s.  The rollout
  jobs the driver submits travel as task arguments: they are counted where they arrive
  (rollout received), not as driver sent.  peak_rss_bytes is the process's peak so far.
- row["object_store"] = {peak_used_bytes, peak_objects, samples}: the node's plasma store,
  sampled every `sample_every` seconds from the raylet (`StoreSampler`).  Ray's public state API
  (`ray.util.state`) needs the dashboard, which the dry run leaves off, and lists referenced
  objects rather than the store's use, so the sampler reads the raylet's store stats through
  `ray._private.internal_api.get_memory_info_reply` (what `ray memory --stats-only` prints).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import ray

from actors.driver.pipeline import run_distributed
from actors.transport.iostats import payload_nbytes, peak_rss_bytes
from opd.config.schema import RunConfig

KEYS = ("received_bytes", "sent_bytes")


class DriverIO:
    """While entered, counts the array bytes `ray.get` returns and `ray.put` takes in this
    process (the driver's); `original_get` is the unwrapped `ray.get` for the bench's own calls."""

    def __init__(self) -> None:
        self.received_bytes = 0
        self.sent_bytes = 0
        self.original_get = ray.get
        self._put = ray.put

    def _get(self, refs, *args, **kwargs):
        value = self.original_get(refs, *args, **kwargs)
        self.received_bytes += payload_nbytes(value)
        return value

    def _put_counted(self, value, *args, **kwargs):
        self.sent_bytes += payload_nbytes(value)
        return self._put(value, *args, **kwargs)

    def __enter__(self) -> DriverIO:
        self.original_get, self._put = ray.get, ray.put
        ray.get, ray.put = self._get, self._put_counted
        return self

    def __exit__(self, *exc) -> None:
        ray.get, ray.put = self.original_get, self._put

    def stats(self) -> dict:
        return {"received_bytes": self.received_bytes, "sent_bytes": self.sent_bytes,
                "peak_rss_bytes": peak_rss_bytes()}


def store_stats() -> dict:
    """The local Ray node's plasma store: bytes used, objects, primary copies, spilled bytes."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    try:
        s = get_memory_info_reply(state, timeout_seconds=10.0).store_stats
    finally:
        state.disconnect()
    return {"used_bytes": int(s.object_store_bytes_used), "objects": int(s.num_local_objects),
            "primary_bytes": int(s.object_store_bytes_primary_copy),
            "spilled_bytes": int(s.spilled_bytes_total)}


class StoreSampler:
    """A daemon thread sampling `store_stats()`; `window(t0, t1)` summarizes the samples taken
    between two `time.perf_counter()` marks."""

    def __init__(self, every: float = 0.25):
        self.every = every
        self.samples: list[tuple[float, dict]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="opd-store-sampler", daemon=True)

    def sample(self) -> bool:
        """Take one sample now; False (and `error` set) if the store could not be read."""
        try:
            self.samples.append((time.perf_counter(), store_stats()))
            return True
        except Exception as e:  # noqa: BLE001 - a private API: report, do not fail the run
            self.error = f"{type(e).__name__}: {e}"
            return False

    def _loop(self) -> None:
        while not self._stop.is_set() and self.sample():
            self._stop.wait(self.every)

    def __enter__(self) -> StoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15.0)

    def window(self, t0: float, t1: float) -> dict:
        got = [s for t, s in self.samples if t0 <= t <= t1]
        if not got:
            return {"peak_used_bytes": None, "peak_objects": None, "spilled_bytes": None,
                    "samples": 0, "error": self.error}
        return {"peak_used_bytes": max(s["used_bytes"] for s in got),
                "peak_objects": max(s["objects"] for s in got),
                "spilled_bytes": got[-1]["spilled_bytes"], "samples": len(got)}


def actor_io(groups, get=ray.get) -> dict[str, dict]:
    """{role: io_stats()} of every live actor of a run (`actors.driver.cluster.ActorGroups`)."""
    actors = {**{f"rollout/{i}": a for i, a in enumerate(groups.rollout)},
              **{f"teacher/{j}": a for j, a in enumerate(groups.teacher)},
              **{f"learner/{r}": a for r, a in enumerate(groups.learners)}}
    stats = get([a.io_stats.remote() for a in actors.values()])
    return dict(zip(actors, stats))


def step_delta(now: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    """Per role: bytes received and sent since `before` (totals), and the peak RSS so far."""
    return {role: {**{k: s[k] - before.get(role, {}).get(k, 0) for k in KEYS},
                   "peak_rss_bytes": s["peak_rss_bytes"]} for role, s in now.items()}


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and every process under it: on a
    local Ray this driver started, the raylet, the GCS and every worker.  Processes that ended
    are no longer counted, so only differences over a window without restarts mean anything."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:              # ended between the listing and the read
            pass
    return total


def run_with_io(cfg: RunConfig, run_dir: str | Path, *, sample_every: float = 0.25,
                **kwargs) -> list[dict]:
    """`run_distributed(cfg, run_dir)` (Ray already connected), its rows each carrying the
    step's "io" (per role), "object_store" (see the module docstring) and "cpu_s": the CPU
    seconds every process of the run used in the step's window (`tree_cpu_seconds`)."""
    per_step: dict[int, dict] = {}
    totals: dict[str, dict] = {}
    mark = [time.perf_counter(), tree_cpu_seconds()]

    def after_step(pipeline, step: int, row: dict) -> None:
        now = {"driver": driver.stats(), **actor_io(pipeline.groups, driver.original_get)}
        sampler.sample()                      # at least one sample in every step's window
        t, cpu = time.perf_counter(), tree_cpu_seconds()
        per_step[step] = {"io": step_delta(now, totals), "object_store": sampler.window(mark[0], t),
                          "cpu_s": cpu - mark[1]}
        totals.clear()
        totals.update(now)
        mark[:] = [t, cpu]

    hooks = {**kwargs.pop("hooks", {}), "after_step": after_step}
    with StoreSampler(sample_every) as sampler, DriverIO() as driver:
        rows = run_distributed(cfg, run_dir, progress=False, hooks=hooks, **kwargs)
    return [{**r, **per_step.get(r["step"], {})} for r in rows]
