"""HB-SJD: Hybrid Batched Speculative Jacobi Decoding, and the round loop the SJD engines share.

Every image has its own cursor and draft window; one batched verifier forward per round runs
the windows of images at different positions (positions (B, W) per row).  Execution of a round:

    Full      all physical rows (rows=None), finished images logically inactive
    Compact   only the active images' rows (rows = index tensor; CFG: idx and idx + B)
    Hybrid    Full while the active count >= gamma, Compact below it

Independent Batched SJD (`sjd_independent`, rollout/baselines/) is HB-SJD with Full execution
and no switching.
The loop synchronises with the device once per round (the active count; eager Compact rounds
also `nonzero` the active mask); everything per image is vectorised.

A round itself, Full or Compact, eager or compiled into one graph (Compact rounds then in
buckets of rows), is rollout/rounds.py's.  With option compile the round state lives in
buffers the engine keeps across calls (rollout/static_states.py), so on CUDA
("reduce-overhead") every replay of a round's graph sees the same addresses.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from rollout.calibrate import calibration_path, model_signature
from rollout.candidates import candidate_tree
from rollout.engine import Engine, Request, make_engine, register, synchronize
from rollout.jacobi import JacobiState, Plan, init_state, make_plan, rewindow
from rollout.rounds import (bucket, compact_round, compact_rows, full_round, full_round_in_place,
                            prefill_round)
from rollout.slots import Slots, single_token
from rollout.spans import Finished, Span, span_cuts, whole_call
from rollout.static_states import StaticStates
from rollout.stats import RoundLog
from rollout.window import WINDOWS, WindowPolicy, policy_clock


def run_jacobi(model, req: Request, plan: Plan, gamma: int, full=None, compact=None,
               hold=None, policy: WindowPolicy | None = None,
               plan_for=None) -> Iterator[Finished]:
    """Round 0 = the prefill with every image's first window (rollout/rounds.py
    `prefill_round`: its forward also verifies W - 1 drafts from the prefix's history, so a
    call takes a round fewer than with a prefill alone), then Jacobi rounds until every image
    has T = P + N tokens.
    plan: the call's constants (`JacobiEngine.plan`).  gamma: Compact execution when fewer than gamma rows are active
    (0 = always Full, > R = always Compact).  full / compact: the compiled `full_round` /
    `compact_round` (Compact rounds then run in buckets), hold: `StaticStates.hold`; None:
    eager rounds of exactly the active rows.  policy (W "auto", rollout/window.py, started for
    this call): each round's window and execution are `policy.choose`'s, gamma unused, each
    round's committed tokens and seconds (`policy.now`) go back to `policy.observe`, and the
    call's tokens to `policy.finish`; plan_for(W) -> the call's Plan of window W (all sized for
    policy.largest); plan is then plan_for(policy.largest).

    With R = req.rows < B physical rows, images run through the rows (rollout/slots.py).  A
    round, after its one device sync (the active count, with the policy's acceptance counts):
    1. refill free rows with waiting images (`Slots.refill`), 2. Full or Compact, and the
    window (`execution`), 3. the round (`full_round` / `compact_round`), 4. tally
    (`RoundLog.add`).

    A generator (`Engine.run_stream`): after a round's sync, the spans every image has now
    committed (`req.span`, rollout/spans.py), then the images it completed (`Finished`) are
    handed out, before their rows are refilled; returns the `RolloutResult`."""
    B, R, T, dev = req.batch, req.rows, req.total, req.labels.device
    log = RoundLog(B, dev)
    now = policy.now if policy is not None else time.perf_counter
    begun_now, away = now(), [0.0]      # the policy's clock; the consumer's time on it

    def hand_out(item):                 # the consumer's time is not the call's
        paused, paused_now = time.perf_counter(), now()
        yield item
        log.pause(paused)
        away[0] += now() - paused_now

    if req.num_new == 1:
        result = single_token(model, req, log.times)
        yield from whole_call(req.prefix_len, req.span, result)
        return result
    slots = Slots(req)
    st = init_state(req, slots.img, plan, model.vocab_size)
    log.prefill(slots.per_image(prefill_round(model, st, slots.img, req, plan, None), None,
                                False), R)
    compiled = full is not None
    if compiled:
        st = hold(st)
    full, compact = full or full_round, compact or compact_round
    handed, n_handed = torch.zeros(R, dtype=torch.bool, device=dev), 0   # rows handed out
    spanned = req.prefix_len             # tokens handed out as spans
    counts = started = room = None       # the last round's counts, start, rows with room
    while True:
        live = st.cur < T
        # sync: the active rows, the least committed row's tokens, the tokens left to commit,
        # and (a policy counting tokens) the round's committed tokens; then its seconds
        stats = [live.sum(), st.cur.min(), (T - st.cur).sum()]
        if room is not None:
            stats += [(counts[0] * room).sum(), room.sum()]
        A, low, left, *tokens = torch.stack(stats).tolist()
        if started is not None:
            policy.observe(*(tokens or (0, 0)), now() - started)
        # 0. hand out the spans every image has committed (waiting images have none yet)
        for a, b in span_cuts(req.prefix_len, T, req.span, spanned,
                              low if slots.waiting == B else req.prefix_len):
            yield from hand_out(slots.span(st, a, b, A > 0))
            spanned = b
        # 0. and the images the last round completed
        if R - A > n_handed:
            yield from hand_out(slots.finished(st, (~live & ~handed).nonzero().squeeze(1), req))
            handed, n_handed = ~live, R - A
        # 1. refill: rows whose images are complete take the waiting images
        if A < R and slots.waiting < B:
            new, first = slots.refill(model, req, st, live, plan)
            log.admit(new, first)
            left += new.shape[0] * (req.num_new - 1)     # (each has its first token, or more)
            A, live = A + new.shape[0], st.cur < T
            handed, n_handed = ~live, R - A
        log.tick()
        if A == 0:
            break
        # 2. Full or Compact, and the window
        if policy is not None:
            started = now()
        is_compact, st, plan = execution(A, left / A, gamma, policy, st, plan, plan_for,
                                         hold if compiled else None)
        if policy is not None and policy.counting:  # rows with a whole window left
            room = (st.cur <= T - plan.W).long()
        # 3. the round
        if is_compact:
            idx = compact_rows(live, A, R, compiled)
            counts = compact(model, st, idx, req, plan)
        else:
            idx, counts = None, full(model, st, req, plan)
        if room is not None and idx is not None:
            room = room[idx]
        # 4. tally
        log.add(slots.per_image(counts, idx, compiled), A, "compact" if is_compact else "full",
                plan.W)
    if policy is not None:
        policy.finish(B * req.num_new, now() - begun_now - away[0])
    tokens, logp = slots.collect(st)
    return log.result(tokens, req.prefix_len, logp[:, req.prefix_len:])


def baseline_call(engine: Engine, model, req: Request,
                  policy: WindowPolicy) -> Iterator[Finished | Span]:
    """A W "auto" call run whole by Cached AR (`engine`; the policy's `AR` arm, never with
    "speculative" decoding): greedy and "sample" commit Cached AR's tokens whatever the
    window, so only time changes, and the call's seconds price the arm.  Its rounds count as
    rounds of window 1 (`RolloutResult.windows`)."""
    started = policy.now()
    result = engine.run(model, req)
    synchronize(req.labels.device)
    policy.finish(req.batch * req.num_new, policy.now() - started)
    result.windows = [0] + [1] * (result.rounds - 1)
    yield from whole_call(req.prefix_len, req.span, result)
    return result


def execution(active: int, left: float, gamma: int, policy: WindowPolicy | None,
              st: JacobiState, plan: Plan, plan_for, hold) -> tuple[bool, JacobiState, Plan]:
    """The next round's execution -> (compact, st, plan): Compact below gamma active rows, or
    (W "auto") `policy.choose`'s window and mode for the active count and the tokens `left`
    per active row, `st` re-windowed to it (and held again when hold is given: compiled
    rounds)."""
    if policy is None:
        return active < gamma, st, plan
    W, compact = policy.choose(active, left)
    if W != plan.W:
        st = rewindow(st, plan, plan_for(W))
        plan = plan_for(W)
        if hold is not None:
            st = hold(st)
    return compact, st, plan


class JacobiEngine(Engine):
    """Shared option handling: window (W = tokens per verifier forward, [last committed,
    W - 1 drafts]), history_offset (H; None = one grid row), decoding (rollout/options.py
    DECODINGS), refresh (decoding "speculative": the drafts after the commit point, "coupled" =
    maximal coupling with their new distribution, "resample" = drawn afresh; both lossless, see
    rollout/jacobi.py).  Independent engines also take candidates (K >= 2: after a correction
    the next window also verifies K - 1 alternatives for the following token as token-tree
    branches, rollout/candidates.py; every decoding; 0 = off) and branch (columns of each
    alternative branch; None = 1)."""

    def __init__(self, **options):
        super().__init__(**options)
        self._states = StaticStates()    # compiled rounds' state buffers

    def history(self, model) -> int:
        """Option history_offset, by default one grid row."""
        H = self.options["history_offset"]
        return model.grid_size if H is None else H

    def check_model(self, model, req: Request) -> None:
        H = self.history(model)
        if H >= model.block_size:
            raise ValueError(f"option history_offset={H} is outside the sequence: the history offset must "
                             f"be in [1, block_size - 1 = {model.block_size - 1}]")

    def gamma(self, model, req: Request) -> int:
        return 0

    def cache_len(self, req: Request) -> int:
        """Cache slots per row: T, plus the branches' scratch slots with candidates."""
        K = self.options.get("candidates", 0)
        return req.total + (K - 1) * (self.options.get("branch") or 1) if K >= 2 else req.total

    def plan(self, model, req: Request, W: int | None = None,
             scratch_len: int | None = None) -> Plan:
        """The constants of a call (`jacobi.make_plan`) at window W (default option window;
        "auto": the largest window the policy may choose); the window is clipped to N - 1
        tokens, the most predictions a round can use."""
        o, H, dev = self.options, self.history(model), req.labels.device
        W = W or (max(WINDOWS) if o["window"] == "auto" else o["window"])
        W = max(1, min(W, req.num_new - 1))
        K = min(o.get("candidates", 0), model.vocab_size)
        drafting = (candidate_tree(W, K, H, dev, o.get("branch"), req.speculative) if K >= 2
                    else None)                                        # None: the plain window
        return make_plan(req.total, W, H, dev, o["refresh"] == "coupled", drafting,
                         model.vocab_size, scratch_len)

    def run_stream(self, model, req: Request) -> Iterator[Finished]:
        """`run_jacobi` with this call's plan, gamma or window policy, and compiled rounds."""
        dev = req.labels.device
        policy = None
        if self.options["window"] == "auto":
            policy = self.policy(model, req)
            if policy.cached_ar:
                return baseline_call(self.baseline, model, req, policy)
            plans = {}

            def plan_for(W: int) -> Plan:
                if W not in plans:
                    plans[W] = self.plan(model, req, W, scratch_len=policy.largest)
                return plans[W]
            plan, gamma = plan_for(policy.largest), 0
        else:
            plan_for = None
            plan, gamma = self.plan(model, req), self.gamma(model, req)
        if not self.compiles:
            return run_jacobi(model, req, plan, gamma, policy=policy, plan_for=plan_for)
        return run_jacobi(model, req, plan, gamma, self.compiled_round(full_round_in_place, dev),
                          self.compiled_round(compact_round, dev), self._states.hold, policy,
                          plan_for)

    def policy(self, model, req: Request) -> WindowPolicy:
        raise ValueError(f"engine {self.name!r} has no window policy: set option window to an int")


@register("hbsjd")
class HBSJD(JacobiEngine):
    """HB-SJD.  execution: full | compact | hybrid; gamma: Compact below this many active
    images (int), 'auto' (read `opd calibrate`'s JSON at option `calibration`, default
    $OPD_CACHE/calibration.json; with calibrate_missing=True a missing entry is measured here,
    a few forwards, and saved under the file's lock), or
    None (uncalibrated fallback: half the batch, rounded up)."""

    def __init__(self, **options):
        super().__init__(**options)
        self._auto: dict[tuple, int] = {}
        self._policies: dict[tuple, WindowPolicy] = {}
        self._baseline: Engine | None = None

    def policy(self, model, req: Request) -> WindowPolicy:
        """window "auto" (rollout/window.py): this engine's policy for (this model, req.rows,
        the call's new tokens N, CFG, decoding), kept across calls so that it learns from every
        rollout of that shape (what a token costs moves with N: prefill and the slowest row's
        last rounds weigh more in a short call, where windows pay less; one policy fed calls of
        64 and 32 tokens by turns priced each arm by the calls it happened to run), started with
        the windows of `WINDOWS` a call of N new tokens can use, and (not "speculative")
        Cached AR, which may run the whole call (`baseline_call`); its modes are what option
        execution allows (hybrid: both, chosen per round; gamma is not used)."""
        o, R = self.options, req.rows
        key = (model_signature(model), R, req.num_new, req.cfg, req.decoding)
        if key not in self._policies:
            modes = {"full": ("full",), "compact": ("compact",)}.get(o["execution"],
                                                                     ("full", "compact"))
            self._policies[key] = WindowPolicy(
                modes, R, (lambda a: bucket(a, R)) if self.compiles else None,
                policy_clock(req.labels.device.type, torch.get_num_threads()))
        policy = self._policies[key]
        windows = sorted({max(1, min(W, req.num_new - 1)) for W in WINDOWS})
        if req.speculative and len(windows) > 1:
            # W 1 rounds between wider ones break speculative sampling's distribution
            # (tests/rollout/test_window.py, the strict xfail): no W 1 with that decoding.
            windows = windows[1:]
        policy.start(windows, baseline=not req.speculative)
        return policy

    @property
    def baseline(self) -> Engine:
        """The Cached AR engine that runs W "auto"'s `AR` calls (same decoding, compile)."""
        if self._baseline is None:
            self._baseline = make_engine("cached_ar", decoding=self.decoding,
                                         compile=self.options["compile"])
        return self._baseline

    def gamma(self, model, req: Request) -> int:
        execution, g = self.options["execution"], self.options["gamma"]
        if execution == "full":
            return 0
        if execution == "compact":
            return req.rows + 1
        if g is None:
            return (req.rows + 1) // 2
        if g == "auto":
            from rollout.calibrate import ensure_calibration, load_gamma
            key = (model_signature(model), req.rows, self.options["window"], req.cfg)
            if key not in self._auto:
                path = calibration_path(self.options)
                try:
                    self._auto[key] = load_gamma(path, model, req.rows, self.options["window"],
                                                 req.cfg)
                except ValueError:
                    if not self.options["calibrate_missing"]:
                        raise
                    entry = ensure_calibration(model, [req.rows], self.options["window"],
                                               cfg=req.cfg, path=path)[req.rows]
                    self._auto[key] = int(entry["gamma"])
            return self._auto[key]
        return g
