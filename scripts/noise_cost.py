"""What decoding "sample" adds to a round: the keyed Gumbel-max noise of every verified column
(rollout/sampling.py `perturb`), against the warp every sampled round already computes.

    python scripts/noise_cost.py [--threads 1] [--repeats 5]

Per (rows B, window W, vocabulary V): the median milliseconds of `warp` (temperature and
softmax of (B, W, V) logits: what decoding "speculative" computes per round too), `perturb`
(the two-level rule: logsumexp per vocabulary block, noise for the blocks and for the tokens of
the winning block, the (B, W, V) score tensor) and, for comparison, flat Gumbel noise for all V
token ids of every column (`gumbel` over (B, W, V): the one-level rule's cost).  CPU, float32
logits.  The rows at V = 16384 are LlamaGen's vocabulary; docs/ROLLOUTS.md has the figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout.sampling import STREAM_GUMBEL, gumbel, perturb, warp

SHAPES = [(32, 4, 17), (32, 16, 17), (16, 16, 16384), (32, 16, 16384)]


def median_ms(fn, repeats: int) -> float:
    fn()                                              # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def noise_cost(B: int, W: int, V: int, repeats: int = 5) -> dict:
    """{"warp_ms", "perturb_ms", "flat_ms"} of one round's columns (B, W) over V tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, W, V, generator=g)
    key = torch.randint(0, 1 << 62, (B, 1, 1), generator=g)
    position = 100 + torch.arange(W).view(1, W, 1)
    vocab = torch.arange(V)
    return {"warp_ms": median_ms(lambda: warp(logits, 1.0, None, None), repeats),
            "perturb_ms": median_ms(lambda: perturb(logits, key, position, 1.0, None, None),
                                    repeats),
            "flat_ms": median_ms(lambda: gumbel(key, position, vocab, STREAM_GUMBEL), repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| B | W | V | warp ms | perturb ms | flat noise ms |")
    print("|---|---|---|---|---|---|")
    for B, W, V in SHAPES:
        c = noise_cost(B, W, V, args.repeats)
        print(f"| {B} | {W} | {V} | {c['warp_ms']:.2f} | {c['perturb_ms']:.2f} | "
              f"{c['flat_ms']:.2f} |")


if __name__ == "__main__":
    main()
