"""`Engine.stream`: images handed out as they complete, exactly the whole call's rows.

The streaming step (docs/STREAMING.md) cuts a step's pieces from these groups, so a group must
hold exactly the tokens and behaviour log-probs `generate` returns for its images, groups must
come in the order their images completed (the round each image's last token was committed),
and a group must be the images of one round, in batch order."""
import pytest
import torch

from rollout import make_engine

CASES = [
    ("cached_ar", {}, None),
    ("sjd_sync", {"window": 4}, None),
    ("sjd_independent", {"window": 4}, None),
    ("hbsjd", {"window": 4, "execution": "full"}, None),
    ("hbsjd", {"window": 4, "execution": "compact"}, None),
    ("hbsjd", {"window": 3, "execution": "hybrid", "gamma": 3}, None),
    ("hbsjd", {"window": 4, "execution": "hybrid", "gamma": 3}, 3),       # slots
    ("hbsjd", {"window": 4, "candidates": 3}, None),
]


def completion_round(result) -> torch.Tensor:
    """(B,) the round in which each image committed its last token."""
    R = result.committed.shape[0]
    rounds = torch.arange(R)[:, None].expand_as(result.committed)
    return torch.where(result.committed > 0, rounds, -1).max(0).values


@pytest.mark.parametrize("decoding", ["greedy", "sample"])
@pytest.mark.parametrize("name,options,slots", CASES)
def test_stream_hands_out_generates_rows_in_completion_order(tiny, batch, name, options, slots,
                                                             decoding):
    model = tiny()
    labels, prefix = batch(model, 6, 3)
    engine = make_engine(name, decoding=decoding, **options)
    kw = dict(cfg_scale=2.0, seed=11, slots=slots)
    whole = engine.generate(model, labels, prefix, 12, **kw)
    stream = engine.stream(model, labels, prefix, 12, **kw)
    groups = list(stream)
    images = torch.cat([g.images for g in groups])
    assert sorted(images.tolist()) == list(range(6))                    # every image once
    for g in groups:
        assert g.images.tolist() == sorted(g.images.tolist())           # batch order
        assert torch.equal(g.tokens, whole.tokens[g.images])
        assert torch.equal(g.logprobs, whole.logprobs[g.images])
    assert torch.equal(stream.result.tokens, whole.tokens)
    assert torch.equal(stream.result.committed, whole.committed)
    if name == "cached_ar":
        assert len(groups) == 1                  # its images complete together
        return
    done = completion_round(stream.result)
    rounds = [set(done[g.images].tolist()) for g in groups]
    assert all(len(r) == 1 for r in rounds)                             # one round each
    order = [r.pop() for r in rounds]
    assert order == sorted(set(order))                                  # in completion order


def test_a_jacobi_stream_hands_out_before_the_last_image_completes(tiny, batch):
    """The point of streaming: the first images are out while others still decode."""
    model = tiny()
    labels, prefix = batch(model, 8, 2)
    stream = make_engine("hbsjd", window=4, decoding="greedy").stream(model, labels, prefix, 14,
                                                                      seed=3)
    groups = list(stream)
    assert len(groups) >= 2
    assert len(set(completion_round(stream.result).tolist())) == len(groups)


def test_the_consumer_keeps_its_own_grad_mode_between_groups(tiny, batch):
    """The engine runs without autograd; code between two groups (the reference loop, a
    worker) runs in its own mode."""
    model = tiny()
    labels, prefix = batch(model, 4, 2)
    with torch.enable_grad():
        for _ in make_engine("hbsjd", window=4).stream(model, labels, prefix, 10):
            assert torch.is_grad_enabled()


@pytest.mark.parametrize("window", [4, "auto"])
def test_the_consumers_time_is_in_no_round_and_not_in_the_call(tiny, batch, monkeypatch, window):
    """On a clock that jumps 100 s while the consumer holds each hand-out (a span or a group),
    no round's seconds and not the call's wall time hold any of it: the rounds' seconds are
    what the bench's per-round figures and the window policy read."""
    import time
    real, jumped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + jumped[0])
    model = tiny()
    labels, prefix = batch(model, 6, 2)
    stream = make_engine("hbsjd", window=window, decoding="greedy").stream(
        model, labels, prefix, 14, seed=3, span=4)
    handed = 0
    for _ in stream:
        jumped[0] += 100.0
        handed += 1
    res = stream.result
    assert handed >= 3 and res.rounds > 3
    assert max(res.round_times) < 50 and res.wall_time < 50, (res.round_times, res.wall_time)


@pytest.mark.parametrize("engine,window", [("hbsjd", "auto"), ("hbsjd", 4), ("cached_ar", None)])
def test_a_calls_cpu_seconds_leave_the_consumer_out(tiny, batch, monkeypatch, engine, window):
    """On a one-thread CPU a call's cpu_time is this thread's CPU seconds over the stretches
    the engine ran (what the window policy prices by, and the run summary's
    `rollout_vs_ar_cpu`): a thread clock that jumps 100 s while the consumer holds each
    hand-out puts none of it there.  With two threads there is none: a thread's CPU seconds
    are not the process's."""
    import time
    real, jumped = time.thread_time, [0.0]
    monkeypatch.setattr(time, "thread_time", lambda: real() + jumped[0])
    model = tiny()
    labels, prefix = batch(model, 6, 2)
    options = {} if window is None else {"window": window}
    stream = make_engine(engine, decoding="greedy", **options).stream(model, labels, prefix,
                                                                      14, seed=3, span=4)
    handed = 0
    for _ in stream:
        jumped[0] += 100.0
        handed += 1
    res = stream.result                     # CPU seconds of one thread: at most its wall time
    assert handed >= 3 and 0 < res.cpu_time <= res.wall_time + 1e-3, (res.cpu_time, res.wall_time)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        res = make_engine(engine, decoding="greedy", **options).generate(model, labels, prefix, 14)
    finally:
        torch.set_num_threads(threads)
    assert res.cpu_time is None
