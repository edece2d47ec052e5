"""What one Jacobi round costs: the verifier forward against the verification step.

    costs = round_costs(model, make_engine("hbsjd", window=4, decoding="sample"), labels, None, 64)
    costs["verify_ops"], costs["forward_ms"], costs["verify_ms"]

The rollout runs as `hbsjd.run_jacobi` runs it with Full execution (every row in every round,
finished rows included), one image per row.  Each round is timed in two parts, side by side
(the same rounds, so a machine's load drifts hit both alike): the verifier forward
(`rounds.forward_window`) and the verification step (`rounds.verify_window`: guidance,
acceptance, coupled refresh, residual draw, history fill, cursor updates).  The first round is
a warm-up and a few rounds run under torch.profiler, both untimed, to count the aten operators
the verification step calls: `verify_ops` counts those called from Python (each is a dispatch,
and on a GPU a kernel launch unless it is a view), `verify_ops_nested` adds the operators they
call inside (allocations, dtype conversions, views).  The counts do not depend on the machine
or on the weights (no branch in a round depends on tensor values); times do.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from rollout.engine import make_request, synchronize
from rollout.hbsjd import JacobiEngine
from rollout.rounds import forward_window, prefill_round, verify_window
from rollout.jacobi import init_state


def count_ops(fn) -> tuple[int, int]:
    """Run fn() under torch.profiler -> (aten operators called from Python, all aten operators
    including the ones those call)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(not _inside_aten(e) for e in events), len(events)


def _inside_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def round_costs(model, engine: JacobiEngine, labels: Tensor, prefix: Tensor | None,
                num_new_tokens: int, *, cfg_scale: float | None = None,
                temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                seed: int = 0, profiled: int = 2) -> dict:
    """Roll out labels (B,) / prefix (B, P) with `engine`'s options (Full execution) and
    return {"rounds": verifier rounds, "forward_ms" / "verify_ms": median of the timed rounds,
    "verify_ops" / "verify_ops_nested": aten operators of one verification step (the largest
    of the `profiled` profiled rounds)}; times are None when every round was a warm-up or
    profiled."""
    req = make_request(model, labels, prefix, num_new_tokens, cfg_scale=cfg_scale,
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       image_ids=None, decoding=engine.decoding)
    engine.check_model(model, req)
    if req.num_new < 2:
        raise ValueError("round_costs needs num_new_tokens >= 2 (one token is only a prefill)")
    plan, dev = engine.plan(model, req), req.labels.device
    was_training = bool(getattr(model, "training", False))
    model.eval()
    forward, verify, ops = [], [], []
    try:
        with torch.inference_mode():
            model.setup_cache(req.batch * (2 if req.cfg else 1), engine.cache_len(req))
            images = torch.arange(req.batch, device=dev)
            st = init_state(req, images, plan, model.vocab_size)
            prefill_round(model, st, images, req, plan, None)
            r = 0
            while bool((st.cur < req.total).any()):
                start = time.perf_counter()
                logits, positions, offset = forward_window(model, st, req, plan, None)
                synchronize(dev)
                mid = time.perf_counter()

                def step():
                    verify_window(model, st, logits, positions, offset, req, plan, None)
                if 1 <= r <= profiled:
                    ops.append(count_ops(step))
                else:
                    step()
                    synchronize(dev)
                    if r > 0:
                        forward.append(mid - start)
                        verify.append(time.perf_counter() - mid)
                r += 1
    finally:
        if was_training:
            model.train()

    def ms(times):               # the median: a shared machine's preemptions hit few rounds
        return 1e3 * statistics.median(times) if times else None
    return {"rounds": r, "forward_ms": ms(forward), "verify_ms": ms(verify),
            "verify_ops": max((o[0] for o in ops), default=None),
            "verify_ops_nested": max((o[1] for o in ops), default=None)}
