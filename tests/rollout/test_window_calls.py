"""The window of each call (rollout/window_calls.py) on given costs of whole calls (seconds per
committed token, no timing): whole calls decide where the rounds' rates mislead, a change of
costs is followed, a compiling first call is dropped, exploration stays within its budget."""
from collections import Counter

from rollout.window import WINDOWS
from rollout.window_calls import AR, AR_MARGIN, CALL_BUDGET, CALL_HORIZON, CallWindows

TOKENS = 64
ROUNDS = {1: 3.0, 2: 5.0, 4: 7.0, 8: 8.9, 16: 9.0}   # the rounds' rates: W 16 rates best


def run(calls: CallWindows, cost: dict, n: int, first_calls: set | None = None) -> list[int]:
    """n calls whose window W takes cost[W] seconds a token (1000 times that on its first
    call where `first_calls` is given: it compiles) -> the windows chosen."""
    chosen = []
    for _ in range(n):
        W = calls.choose(WINDOWS, ROUNDS)
        compile_ = first_calls is not None and W not in first_calls
        calls.observe(cost[W] * TOKENS * (1000 if compile_ else 1), TOKENS)
        if first_calls is not None:
            first_calls.add(W)
        chosen.append(W)
    return chosen


def test_nothing_measured_runs_the_rounds_rule():
    calls = CallWindows()
    assert calls.choose(WINDOWS, {}) is None
    calls.observe(1.0, TOKENS)                   # the rounds' rule's call: not counted
    assert calls.measured(WINDOWS) == {}
    assert calls.choose(WINDOWS, ROUNDS) == 16


def test_whole_calls_decide_where_the_rounds_rates_mislead():
    """The rounds rate W 16 best (its rounds commit most per second), but its calls take 1.16
    times W 8's (a part-empty last round, the slowest image): after W 16 the search runs its
    neighbour W 8 and measures W 4 on the next call (a first measurement is not held to the
    budget); from the third call on 89 % of the calls run W 8, the rest explore W 4 and W 16."""
    cost = {1: 3.0, 2: 2.0, 4: 1.3, 8: 1.0, 16: 1.16}
    chosen = run(CallWindows(), cost, 40)
    assert chosen[:2] == [16, 8]
    assert chosen[:4] == [16, 8, 4, 8], chosen
    assert Counter(chosen[2:]) == {8: 34, 4: 2, 16: 2}, chosen   # 89 % W 8


def test_a_change_of_costs_is_followed():
    """Settled on W 8, the costs change so that W 4 is cheapest: within 20 calls the policy
    runs W 4 (on its eighth call: W 4 was measured, so exploring it waits for the budget), and
    then 91 % of its calls."""
    calls = CallWindows()
    run(calls, {1: 3.0, 2: 2.0, 4: 1.3, 8: 1.0, 16: 1.16}, 40)
    chosen = run(calls, {1: 3.0, 2: 1.6, 4: 0.9, 8: 1.0, 16: 1.16}, 40)
    assert chosen.index(4) == 7
    assert Counter(chosen[7:]) == {4: 30, 2: 2, 8: 1}, chosen   # 91 % W 4


def test_a_compiling_first_call_is_dropped():
    """Compiled (warm=False), a window's first call costs 1000 times more: it is not counted,
    and the search still climbs to the cheapest window, W 4, and keeps to it (80 % of its last
    20 calls), exploring only its neighbours."""
    chosen = run(CallWindows(warm=False), {1: 3.0, 2: 1.6, 4: 0.9, 8: 1.0, 16: 1.16}, 40,
                 first_calls=set())
    assert chosen[:4] == [16, 16, 8, 8]
    assert Counter(chosen[-20:]) == {4: 18, 8: 1, 2: 1}, chosen


def test_exploration_stays_within_its_budget():
    """Once every neighbour of the leader is measured, the discounted seconds of exploring
    calls stay at most CALL_BUDGET of all calls' plus the one call that crossed it."""
    calls = CallWindows()
    cost = {1: 3.0, 2: 2.0, 4: 1.05, 8: 1.0, 16: 1.06}
    run(calls, cost, 10)
    chosen = []
    for _ in range(100):
        chosen += run(calls, cost, 1)
        explored, total = calls.spent
        assert explored <= CALL_BUDGET * total + max(cost.values()) * TOKENS
    assert Counter(chosen) == {8: 92, 16: 4, 4: 4}, chosen   # 8 calls in 100 explore


WITH_AR = (AR, *WINDOWS)


def run_with_ar(calls: CallWindows, cost: dict, n: int) -> list[int]:
    """n calls, Cached AR among the arms; the rounds' rates are ROUNDS scaled so that W 1's is
    what its calls commit a second (a W-1 round commits a token a row, so its call is its
    rounds)."""
    rates = {W: r / ROUNDS[1] / cost[1] for W, r in ROUNDS.items()}
    chosen = []
    for _ in range(n):
        W = calls.choose(WITH_AR, rates)
        calls.observe(cost[W] * TOKENS, TOKENS)
        chosen.append(W)
    return chosen


def test_cached_ar_leads_where_it_is_cheapest():
    """A compute-bound batch (CFG, 32 rows on a CPU): the rounds rate W 16 best, but Cached AR
    is the cheapest call.  Cached AR is measured on the second call and leads from then on;
    the windows' search goes on from the cheapest window (W 8, W 4, W 2: one call each), then
    explores within the budget."""
    cost = {AR: 1.0, 1: 1.12, 2: 1.15, 4: 1.12, 8: 1.3, 16: 1.8}
    chosen = run_with_ar(CallWindows(), cost, 40)
    assert chosen[:5] == [16, AR, 8, 4, 2], chosen
    assert Counter(chosen[1:]) == {AR: 33, 8: 2, 4: 2, 2: 2}, chosen


def test_cached_ar_is_no_trap():
    """Cached AR is no window: it runs W 1's forward without the Jacobi bookkeeping, so it can
    beat W 1 and W 16 and lose to W 4.  Leading after the first window's call, it does not
    stop the windows' search, which climbs from the cheapest window to W 4 (before, the search
    looked only beside the leader, Cached AR's neighbour W 1, and kept Cached AR: 11 % slower)."""
    cost = {AR: 1.0, 1: 1.12, 2: 0.97, 4: 0.9, 8: 1.05, 16: 1.3}
    chosen = run_with_ar(CallWindows(), cost, 40)
    assert chosen[:5] == [16, AR, 8, 4, 2], chosen
    assert Counter(chosen[5:]) == {4: 32, AR: 1, 2: 1, 8: 1}, chosen   # 91 % W 4


def test_w1_runs_no_call_beside_cached_ar():
    """W 1 commits a token a row a round, as Cached AR does, with the Jacobi bookkeeping on top:
    with Cached AR an arm, W 1 runs no call.  W 2 is the cheapest window here; before, the
    search also measured its neighbour W 1 and explored it once more (2 of 40 calls, each 6 %
    dearer than W 2's).  And where the rounds rate W 1 best, the first call goes to Cached AR;
    without Cached AR (speculative decoding leaves it out), to W 1."""
    cost = {AR: 1.0, 1: 1.03, 2: 0.97, 4: 1.05, 8: 1.3, 16: 1.8}
    chosen = run_with_ar(CallWindows(), cost, 40)
    assert chosen[:5] == [16, AR, 8, 4, 2], chosen
    assert Counter(chosen) == {2: 33, AR: 3, 4: 2, 16: 1, 8: 1}, chosen
    assert CallWindows().choose(WITH_AR, {1: 10.0, 2: 9.0, 4: 5.0}) == AR
    assert CallWindows().choose(WINDOWS, {1: 10.0, 2: 9.0, 4: 5.0}) == 1   # no Cached AR


def test_a_compute_bound_search_starts_at_the_middle():
    """Compute-bound (CFG, 32-64 rows on a CPU): no window's rounds commit 1.5 times W 1's a
    second, and the rounds rate W 16 best (at CFG batch 32 its calls took 1.6-2.8 times
    Cached AR's: a wide window's call loses most to its slowest image).  The search starts at W 4,
    the axis's middle, so it never runs W 16 (before: W 16, Cached AR, W 8, W 4, W 2: 22.64
    Cached AR calls' seconds in 21 calls, now 21.84); where W 4 is cheapest, it runs W 4 from
    the fifth call."""
    rates = {W: r / 1.12 for W, r in {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.25, 16: 1.3}.items()}
    assert max(rates.values()) <= AR_MARGIN * rates[1]
    for cost, best, other in (({AR: 1.0, 1: 1.12, 2: 1.15, 4: 1.12, 8: 1.3, 16: 1.8}, AR, 4),
                              ({AR: 1.0, 1: 1.12, 2: 0.97, 4: 0.9, 8: 1.05, 16: 1.3}, 4, AR)):
        calls, chosen = CallWindows(), []
        for _ in range(21):
            chosen.append(calls.choose(WITH_AR, rates))
            calls.observe(cost[chosen[-1]] * TOKENS, TOKENS)
        assert chosen[:4] == [4, AR, 8, 2], chosen
        assert Counter(chosen) == {best: 16, other: 2, 2: 2, 8: 1}, chosen


def test_cached_ar_is_measured_where_it_may_lead():
    """W 8 is cheapest and Cached AR costs 1.3 times as much, W 1's rounds 1.45 times: within
    AR_MARGIN of the leader, so Cached AR runs on the second call (a first measurement,
    outside the exploring budget) and once more as an exploring call; W 1 never runs."""
    cost = {AR: 1.3, 1: 1.45, 2: 1.2, 4: 1.1, 8: 1.0, 16: 1.16}
    chosen = run_with_ar(CallWindows(), cost, 60)
    assert chosen[:4] == [16, AR, 8, 4], chosen
    assert Counter(chosen) == {8: 53, 16: 3, 4: 2, AR: 2}, chosen


def test_cached_ar_out_of_reach_waits_for_the_first_call_to_be_forgotten():
    """W 1's rounds commit a token a second where the leader's calls commit 3.5 (batch 1-8:
    Cached AR took 1.8-3 times the best window's call): more than AR_MARGIN apart, so the
    first CALL_HORIZON calls spend none on Cached AR (one costs 2.5 leader's calls) and the
    windows' search is as without it.  W 1's rounds are measured in the first call only (W 1
    runs no call beside Cached AR), so the gate would hold for good on one slow W-1 round
    there (in a default run the 32-token policy never ran Cached AR, at 1.18 of its time):
    once the calls have forgotten that call, Cached AR is measured, once."""
    cost = {AR: 2.5, 1: 3.5, 2: 2.0, 4: 1.3, 8: 1.0, 16: 1.16}
    assert 1 / cost[16] > AR_MARGIN * (1 / cost[1])
    chosen = run_with_ar(CallWindows(), cost, 60)
    assert chosen[:10] == run(CallWindows(), cost, 10)          # CALL_HORIZON calls
    assert CALL_HORIZON == 10 and chosen.count(AR) == 1, chosen
    assert chosen.index(AR) == CALL_HORIZON, chosen             # the gate opens at call 10
    assert Counter(chosen) == {8: 53, 16: 3, 4: 3, AR: 1}, chosen


def test_calls_of_two_lengths_are_priced_apart():
    """What a token costs moves with the call's length: prefill and the slowest row's last
    rounds weigh more in a short call, where windows pay less (at the default step, one
    thread, 64-token calls of W 8 took 0.82-0.88 of Cached AR's, 32-token ones 0.96-1.11,
    and a Cached AR token cost 1.5 times as much in the short calls).  Calls of both lengths
    by turns: one CallWindows per length (the engine keeps a policy per N, rollout/hbsjd.py)
    settles each on its own cheapest arm; one for both prices each arm by the lengths it
    happened to run, and its calls take longer."""
    costs = {64: {AR: 1.0, 1: 1.1, 2: 1.05, 4: 0.95, 8: 0.85, 16: 0.97},
             32: {AR: 1.5, 1: 1.65, 2: 1.6, 4: 1.58, 8: 1.62, 16: 1.75}}
    rates = {N: {W: r / ROUNDS[1] / c[1] for W, r in ROUNDS.items()} for N, c in costs.items()}
    apart, shared = {N: CallWindows() for N in costs}, CallWindows()
    chosen = {"apart": {64: [], 32: []}, "shared": {64: [], 32: []}}
    seconds = {"apart": 0.0, "shared": 0.0}
    for k in range(80):
        N = 64 if k % 2 == 0 else 32
        for name, calls in (("apart", apart[N]), ("shared", shared)):
            W = calls.choose(WITH_AR, rates[N])
            calls.observe(costs[N][W] * N, N)
            chosen[name][N].append(W)
            seconds[name] += costs[N][W] * N if k >= 20 else 0.0   # the last 60
    assert Counter(chosen["apart"][64][10:]) == {8: 28, AR: 1, 4: 1}, chosen
    assert Counter(chosen["apart"][32][10:]) == {AR: 28, 8: 1, 2: 1}, chosen
    assert Counter(chosen["shared"][32][10:]) == {8: 21, 16: 4, AR: 3, 4: 2}, chosen
    best = 30 * sum(min(cost.values()) * N for N, cost in costs.items())   # the last 60 calls
    assert seconds["apart"] <= 1.01 * best                    # 1.008
    assert seconds["shared"] >= 1.05 * best                   # 1.058
