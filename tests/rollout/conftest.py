"""Tiny float64 models with peaked, varied distributions (the preset zero-inits the head)."""
import pytest
import torch

from opd.models import create_model


def _tiny(seed: int = 0, std: float = 0.5, **overrides):
    torch.manual_seed(seed)
    m = create_model("GPT-tiny", **overrides).double().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared 2-core machine: intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny():
    """tiny(seed=0, std=0.5, **ModelArgs overrides) -> float64 GPT-tiny (cached per args)."""
    cache = {}

    def make(seed: int = 0, std: float = 0.5, **overrides):
        key = (seed, std, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = _tiny(seed, std, **overrides)
        return cache[key]
    return make


@pytest.fixture
def batch():
    """batch(model, B, P, seed) -> labels (B,), prefix (B, P) drawn from a fixed generator."""
    def make(model, B: int, P: int, seed: int = 0):
        g = torch.Generator().manual_seed(1000 + seed)
        labels = torch.randint(0, model.num_classes, (B,), generator=g)
        prefix = torch.randint(0, model.vocab_size, (B, P), generator=g)
        return labels, prefix
    return make
