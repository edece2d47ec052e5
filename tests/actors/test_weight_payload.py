"""Weight payload bytes are counted where the payload is made (learner rank 0), and the driver
never fetches the weights to count them (it used to pull the full state dict every publish)."""
import ray
import torch

from actors.pipeline import run_distributed
from opd.config import load_config
from opd.models import create_model
from opd.pretrain import model_overrides


def carries_weights(value) -> bool:
    if isinstance(value, dict):
        return "weights" in value or any(carries_weights(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(carries_weights(v) for v in value)
    return False


def test_learner_counts_the_weight_bytes_and_the_driver_never_fetches_them(
        ray_session, tiny_overrides, tmp_path, monkeypatch):
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=2", "rollout.gamma=2",
                               "run.checkpoint_every=0", "eval.track=false",
                               "rollout.num_cpus=0.25", "teacher.num_cpus=0.25",
                               "learner.num_cpus=0.5"])
    fetched = []
    real_get = ray.get

    def spy(refs, *args, **kwargs):
        value = real_get(refs, *args, **kwargs)
        fetched.append(value)
        return value

    monkeypatch.setattr(ray, "get", spy)
    rows = run_distributed(cfg, tmp_path, progress=False)
    monkeypatch.setattr(ray, "get", real_get)
    student = create_model(cfg.model.student, **model_overrides(cfg))
    nbytes = sum(t.numel() * t.element_size() for t in student.state_dict().values()
                 if t.dtype == torch.float32)
    assert nbytes == sum(t.numel() * 4 for t in student.state_dict().values())   # all fp32
    assert [r["weight_bytes"] for r in rows] == [nbytes, nbytes]
    assert not any(carries_weights(v) for v in fetched)
    counts = [v for v in fetched if isinstance(v, list) and v and all(type(x) is int for x in v)]
    assert counts == [[nbytes], [nbytes]]       # what it fetched of the two publishes: the sizes
