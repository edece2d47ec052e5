"""The driver orchestrates and never receives a payload: trajectories go from the workers
through the object store to the learner ranks (each fetches only its rows), weights from the
learner to the rollout workers; the driver gets counts.

One Ray run (2 steps, 2 rollout workers, 1 teacher worker, 2 learner ranks, top-k scores) with
`ray.get` of the driver process instrumented: every value it returns is recorded.
"""
import pickle

import numpy as np
import pytest
import ray
import torch

from actors.driver.pipeline import run_distributed
from opd.config.schema import load_config
from opd.models import create_model
from opd.models.factory import model_overrides


def carries(value, what) -> bool:
    """Does `value` (nested dicts, lists, dataclasses) hold something `what(x)` says is payload?"""
    if what(value):
        return True
    if isinstance(value, dict):
        return any(carries(v, what) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(carries(v, what) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return any(carries(getattr(value, f), what) for f in value.__dataclass_fields__)
    return False


def is_array(x) -> bool:
    return isinstance(x, (np.ndarray, torch.Tensor))


def is_weights(x) -> bool:
    return isinstance(x, dict) and "weights" in x


@pytest.fixture(scope="module")
def run(ray_session, tiny_overrides, tmp_path_factory):
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=2", "rollout.gamma=2",
                               "run.checkpoint_every=0", "eval.track=false",
                               "rollout.num_workers=2", "learner.world_size=2",
                               "teacher.transport=topk", "teacher.topk=4",
                               "rollout.num_cpus=0.25", "teacher.num_cpus=0.25",
                               "learner.num_cpus=0.5"])
    fetched = []
    real_get = ray.get

    def spy(refs, *args, **kwargs):
        value = real_get(refs, *args, **kwargs)
        fetched.append(value)
        return value

    ray.get = spy
    try:
        rows = run_distributed(cfg, tmp_path_factory.mktemp("run"), progress=False)
    finally:
        ray.get = real_get
    return cfg, rows, fetched


def test_the_driver_never_receives_a_trajectory_or_weights(run):
    cfg, rows, fetched = run
    assert len(fetched) > 20                                  # the spy saw the run's answers
    assert not any(carries(v, is_array) for v in fetched)     # no array of any payload
    assert not any(carries(v, is_weights) for v in fetched)
    biggest = max(len(pickle.dumps(v)) for v in fetched)
    piece = min(r["delivered_bytes"] for r in rows) // 4      # 2 parts x 2 ranks
    assert biggest < piece, (biggest, piece)                  # smaller than one rank's piece


def test_each_learner_rank_receives_only_its_rows(run):
    """B 4 over 2 ranks: each rank fetched exactly half of the bytes the workers delivered (its
    2 rows), and nothing else."""
    cfg, rows, _ = run
    for r in rows:
        half = r["delivered_bytes"] // 2
        assert r["delivered_bytes"] == 2 * half
        assert r["learner_received_bytes"] == [half, half]


def test_learner_counts_the_weight_bytes_and_the_driver_reads_only_the_count(run):
    cfg, rows, fetched = run
    student = create_model(cfg.model.student, **model_overrides(cfg))
    nbytes = sum(t.numel() * 4 for t in student.state_dict().values())      # all fp32
    assert [r["weight_bytes"] for r in rows] == [nbytes, nbytes]
    counts = [v for v in fetched if isinstance(v, list) and v and all(type(x) is int for x in v)]
    assert counts == [[nbytes, 0], [nbytes, 0]]   # the two publishes: rank 0's size, rank 1's 0
