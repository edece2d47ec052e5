"""Keyed RNG, CFG combination, temperature / top-k / top-p warps, inverse-CDF sampling."""
import math

import pytest
import torch

from rollout.sampling import (check_sampling, guide, image_key, sample_from, splitmix64,
                              uniform, uses_cfg, warp)

M64 = (1 << 64) - 1


def keyed(seed, image, position, attempt, stream):
    """The uniforms of (seed, image id, position, attempt, stream), as the engines draw them."""
    return uniform(image_key(seed, image), position, attempt, stream)


def splitmix64_ref(x: int) -> int:
    """The reference splitmix64 finaliser on Python ints (unsigned 64-bit)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def to_u64(t: torch.Tensor) -> list[int]:
    return [v & M64 for v in t.tolist()]


def test_splitmix64_matches_the_reference_bit_for_bit():
    xs = [0, 1, 2, 12345, -1, -(1 << 63), (1 << 63) - 1, 0x0123456789ABCDEF, -987654321]
    got = to_u64(splitmix64(torch.tensor(xs, dtype=torch.int64)))
    assert got == [splitmix64_ref(x & M64) for x in xs]


def test_keyed_uniform_is_a_pure_function_of_the_key():
    seed, img = torch.tensor([[5], [5]]), torch.tensor([[0], [1]])
    pos, att = torch.arange(8)[None].expand(2, -1), torch.zeros(2, 8, dtype=torch.long)
    u = keyed(seed, img, pos, att, 0)
    assert u.dtype == torch.float64 and u.shape == (2, 8)
    assert torch.equal(u[1], keyed(torch.tensor(5), torch.tensor(1), torch.arange(8),
                                           torch.tensor(0), 0))
    assert not torch.equal(u[0], u[1])
    for changed in (keyed(seed + 1, img, pos, att, 0),
                    keyed(seed, img, pos, att + 1, 0),
                    keyed(seed, img, pos, att, 1),
                    keyed(seed, img, pos + 1, att, 0)):
        assert (changed != u).all()


def test_keyed_uniforms_look_uniform_and_independent():
    n = 200_000
    u = keyed(torch.tensor(0), torch.arange(n) % 97, torch.arange(n) // 97,
                      torch.tensor(3), 2)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 45                                       # 19 dof, p ~ 1e-3
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


def test_guide_combines_conditional_and_unconditional_rows():
    cond, uncond = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    out = guide(torch.cat([cond, uncond]), 2.5)
    assert torch.allclose(out, uncond + 2.5 * (cond - uncond))
    assert guide(cond, None) is cond and guide(cond, 1.0) is cond
    assert not uses_cfg(1.0) and not uses_cfg(None) and uses_cfg(0.0) and uses_cfg(2)


def test_warp_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64)
    p = warp(logits, 1.0, None, None)
    assert torch.allclose(p, logits.float().softmax(-1))
    assert torch.allclose(warp(logits, 0.5, None, None), (logits.float() / 0.5).softmax(-1))
    k2 = warp(logits, 1.0, 2, None)
    assert (k2[0, 2:] == 0).all() and torch.allclose(k2[0, :2], logits[0, :2].float().softmax(-1))
    assert torch.allclose(warp(logits, 1.0, 5, None), p)
    # sorted mass: .543, .743, .865, .937, 1 -> top_p 0.6 keeps the first two (HF rule)
    tp = warp(logits, 1.0, None, 0.6)
    assert tp[0].nonzero().flatten().tolist() == [0, 1]
    assert torch.allclose(warp(logits, 1.0, None, 1.0), p)
    assert warp(logits, 1.0, None, 1e-6)[0].nonzero().flatten().tolist() == [0]
    assert warp(logits, 1.0, 3, 0.99)[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]])
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999], dtype=torch.float64)
    assert sample_from(probs.expand(4, -1), u).tolist() == [1, 1, 3, 3]
    n = 40_000
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    u = keyed(torch.tensor(1), torch.arange(n), torch.tensor(0), torch.tensor(0), 0)
    freq = torch.bincount(sample_from(p.expand(n, -1), u), minlength=4).double() / n
    assert freq[1] == 0 and torch.allclose(freq, p.double(), atol=0.01)
    # unnormalised input is normalised
    assert torch.equal(sample_from(3 * p.expand(n, -1), u), sample_from(p.expand(n, -1), u))


@pytest.mark.parametrize("kwargs,word", [
    (dict(cfg_scale=math.inf), "cfg_scale"),
    (dict(temperature=0.0), "temperature"),
    (dict(top_k=12), "top_k"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_check_sampling_names_the_argument(kwargs, word):
    args = dict(cfg_scale=None, temperature=1.0, top_k=None, top_p=None, sampled=True)
    with pytest.raises(ValueError, match=word):
        check_sampling(11, **{**args, **kwargs})


def test_greedy_ignores_temperature():
    check_sampling(11, None, 0.0, None, None, sampled=False)
