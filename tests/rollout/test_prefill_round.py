"""The prefill is an image's first Jacobi round (rollout/rounds.py `prefill_round`): its forward
also verifies the first window's W - 1 drafts, filled from the prefix's history (the token H
before, the last prefix token where that falls before the image, token 0 without a prefix).
Round 0 then commits token P and each leading draft that equals Cached AR's token, counted
exactly here, with and without slots; the equality tests of every engine cover the tokens."""
import pytest
import torch

from rollout import make_engine


def first_drafts(prefix: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """The history drafts of tokens P .. P + W - 2, by the rule the module docstring states."""
    B, P = prefix.shape
    if P == 0:
        return torch.zeros(B, W - 1, dtype=torch.long)
    src = [P - H + (j - P) % H for j in range(P, P + W - 1)]
    return prefix[:, [s if s >= 0 else P - 1 for s in src]]


def expected_first_round(tokens: torch.Tensor, prefix: torch.Tensor, H: int, W: int) -> list:
    """1 + the leading drafts equal to Cached AR's tokens, per image."""
    P = prefix.shape[1]
    same = (first_drafts(prefix, H, W) == tokens[:, P:P + W - 1]).long()
    return (1 + same.cumprod(1).sum(1)).tolist()


@pytest.mark.parametrize("decoding", ["greedy", "sample"])
@pytest.mark.parametrize("P,cfg,slots", [(0, None, None), (2, 2.0, None), (6, None, 3)])
def test_round_zero_commits_the_drafts_cached_ar_commits(tiny, decoding, P, cfg, slots):
    model = tiny(2, std=0.5)
    B, W, H = 8, 4, model.grid_size
    g = torch.Generator().manual_seed(P)
    labels = torch.randint(0, model.num_classes, (B,), generator=g)
    N = model.block_size - P
    # prefixes the model wrote itself, whose next tokens often repeat a grid row's: drafts taken
    ref0 = make_engine("cached_ar", decoding=decoding).generate(
        model, labels, None, model.block_size, cfg_scale=cfg, seed=4)
    prefix = ref0.tokens[:, :P]
    ref = make_engine("cached_ar", decoding=decoding).generate(
        model, labels, prefix, N, cfg_scale=cfg, seed=5)
    res = make_engine("hbsjd", window=W, decoding=decoding).generate(
        model, labels, prefix, N, cfg_scale=cfg, seed=5, slots=slots)
    assert torch.equal(res.tokens, ref.tokens)
    want = expected_first_round(ref.tokens, prefix, H, W)
    first = (torch.zeros(B, dtype=torch.long) if res.first_round is None else res.first_round)
    got = res.committed[first, torch.arange(B)].tolist()
    assert got == want and max(want) > 1               # some drafts were accepted
    assert res.windows[0] == 0 and res.progress[1].tolist()[:(slots or B)] == [
        P + w for w in want[:(slots or B)]]
