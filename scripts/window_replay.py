"""Replay `window: auto`'s call rule (rollout/window_calls.py `CallWindows`) on recorded calls.

On a shared machine a bench of `auto` against fixed windows measures the machine as much as the
policy: calls of one window vary by 10-50 % within minutes, so two runs of the same code differ
more than two policies do.  This script separates the two:

    record   runs every arm (Cached AR, fixed W 1, 2, 4, 8, 16, and auto) interleaved in
             `opd bench rollout`'s machinery (launch/bench/rollout.py) and keeps every call's
             seconds, with the rounds' rates that the auto engine's first call measured (what
             the call rule starts from);
    replay   runs `CallWindows` on those seconds: call i of a replay runs at recorded repeat
             s + i (or s - i; every start s, both ways, wrapping round), taking the seconds its
             chosen arm took there, so that a burst of another process slows every arm alike,
             as it does in the bench, whose arms take turns (a call's seconds share about half
             their variance with the other arms' calls of the same repeat).  Per replay: the
             median of 21 timed calls (the bench's figure, after the rounds' rule's call)
             against the fastest arm's median over the same repeats, and the mean of the calls
             (what a user waits for) against the cheapest arm's.  A perfect policy's figure
             (the best arm's own calls at those repeats) is printed beside it: the noise no
             policy can beat.  `--skip N` runs N calls before the timed ones: the rule once
             its first measurements are made, as a training run sees it after a few steps.

    python scripts/window_replay.py record --batch 32 --threads 1 --decoding sample \\
        --set prefix_ratio=0 --set cfg_scale=null --out rec/b32_t1.json
    python scripts/window_replay.py replay rec/*.json
    git show REV:rollout/window_calls.py > old.py
    python scripts/window_replay.py replay rec/*.json --policy old.py    # another commit's rule

The replay ranks rules on one set of recorded calls; the bench stays the measure of speed
(docs/WINDOW_POLICY.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics as st
from pathlib import Path

from rollout import window_calls
from rollout.window import WINDOWS


def record(a) -> None:
    from launch.bench import rollout as bench
    from launch.commands.bench import _overrides
    overrides = dict(checkpoint=a.checkpoint, batch_sizes=[a.batch], decodings=[a.decoding],
                     windows=[*WINDOWS, "auto"], engines=["hbsjd-hybrid"], repeats=a.repeats,
                     threads=a.threads, **_overrides(a.set))
    b = bench.load_bench(a.preset, overrides)
    seen, autos = {}, []
    measure, make = bench.measure, bench.make_engine

    def keep_times(calls, *args, **kw):
        grid = measure(calls, *args, **kw)
        seen["times"] = [m.times for m in grid]
        seen["tokens"] = calls[0].labels.shape[0] * calls[0].new_tokens
        return grid

    def keep_auto(**kw):
        engine = make(**kw)
        if kw.get("window") == "auto":
            autos.append(engine)
        return engine
    bench.measure, bench.make_engine = keep_times, keep_auto
    rows = bench.run_bench(b, log=lambda *_: None)["rows"]
    policy = next(iter(autos[0]._policies.values()))
    compact = policy.modes == ("compact",)
    rates = {W: e[0] for W in WINDOWS
             if (e := policy.estimate(W, compact, policy.rows)) is not None}
    arms = {("AR" if r["engine"] == "cached_ar" else str(r["W"])): t
            for r, t in zip(rows, seen["times"])}
    out = {"arms": arms, "rates": {str(W): r for W, r in rates.items()},
           "tokens": seen["tokens"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out))
    print(a.out, {k: round(st.median(v) * 1e3, 1) for k, v in arms.items()}, "ms (medians)")


def replay_one(rule, data: dict, start: int, step: int, skip: int = 0,
               n: int = 21) -> tuple[float, float, float]:
    """(auto's median / the fastest arm's, the best arm's / the fastest's, auto's mean / the
    cheapest arm's mean) of n timed calls at repeats start + step * i (after `skip` calls)."""
    arms = {k: v for k, v in data["arms"].items() if k != "auto"}
    rates = {int(W): r for W, r in data["rates"].items()}
    repeats = len(arms["1"])
    calls, times, slots = rule.CallWindows(warm=True), [], []
    for i in range(skip + n):
        slot = (start + step * i) % repeats
        W = calls.choose((rule.AR, *WINDOWS), rates)    # greedy, sample: Cached AR too
        t = arms["AR" if W == rule.AR else str(W)][slot]
        calls.observe(t, data["tokens"])
        if i >= skip:
            times.append(t)
            slots.append(slot)
    medians = {k: st.median(v[s] for s in slots) for k, v in arms.items()}
    means = {k: st.mean(v[s] for s in slots) for k, v in arms.items()}
    best = min(arms, key=lambda k: st.median(arms[k]))
    fastest = min(medians.values())
    return st.median(times) / fastest, medians[best] / fastest, st.mean(times) / min(means.values())


def replay(a) -> None:
    rule = window_calls
    if a.policy:
        spec = importlib.util.spec_from_file_location("replayed_rule", a.policy)
        rule = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(rule)
    cells = []
    for f in a.files:
        data = json.loads(Path(f).read_text())
        r = [replay_one(rule, data, s, step, a.skip)
             for s in range(len(data["arms"]["1"])) for step in (1, -1)]
        cells.append([st.mean(x[0] for x in r), sum(x[0] > 1.05 for x in r) / len(r),
                      st.mean(x[1] for x in r), st.mean(x[2] for x in r)])
        print(f"{Path(f).stem:24s} auto/fastest {cells[-1][0]:.3f} (over 1.05: "
              f"{cells[-1][1]:.0%})  perfect {cells[-1][2]:.3f}  mean {cells[-1][3]:.3f}")
    print(f"{'all cells':24s} auto/fastest {st.mean(c[0] for c in cells):.3f} (over 1.05: "
          f"{st.mean(c[1] for c in cells):.0%})  perfect {st.mean(c[2] for c in cells):.3f}  "
          f"mean {st.mean(c[3] for c in cells):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="every arm's call seconds, interleaved")
    r.add_argument("--preset", default="digits")
    r.add_argument("--checkpoint", default="pretrained")
    r.add_argument("--batch", type=int, required=True)
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--decoding", default="sample", choices=["greedy", "sample"])
    r.add_argument("--repeats", type=int, default=40)
    r.add_argument("--set", action="append", default=[], help="a preset key=value")
    r.add_argument("--out", required=True)
    q = sub.add_parser("replay", help="the call rule on recorded calls, at their repeats")
    q.add_argument("files", nargs="+")
    q.add_argument("--policy", help="a window_calls.py to replay instead of this tree's")
    q.add_argument("--skip", type=int, default=0, help="calls run before the timed 21")
    a = p.parse_args()
    record(a) if a.command == "record" else replay(a)


if __name__ == "__main__":
    main()
