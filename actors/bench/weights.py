"""How long one policy version takes to reach N rollout workers, against one in-process copy.

    python -m actors.bench.weights --preset GPT-B --workers 2 --repeats 3

Paths timed (median of repeats, seconds):
    deepcopy       copy.deepcopy of the flat numpy dict in this process
    load_state     model.load_state_dict of that dict into a model here
    put            ray.put of the tagged dict (one object)
    object_store   put + every worker's load_weights (zero-copy read, copy into its model)
    broadcast      a gloo (CPU) / nccl (GPU) broadcast group: this process sends, workers receive
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import ray
import torch

from actors.transport.weights import (BroadcastGroup, free_port, make_buckets, state_dict_to_numpy,
                                      tag_weights, weights_nbytes)
from actors.workers.rollout import RolloutWorker
from opd.config.schema import load_config
from opd.models import create_model


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(preset: str = "GPT-B", workers: int = 2, repeats: int = 3, bucket_mb: float = 64.0,
          vocab_size: int = 16384, num_classes: int = 1000, grid_size: int = 16) -> dict:
    torch.manual_seed(0)
    overrides = dict(vocab_size=vocab_size, num_classes=num_classes, grid_size=grid_size)
    model = create_model(preset, **overrides)
    weights = state_dict_to_numpy(model)
    out = {"preset": preset, "workers": workers, "bytes": weights_nbytes(weights),
           "params": sum(p.numel() for p in model.parameters())}
    out["deepcopy"] = _median(lambda: copy.deepcopy(weights), repeats)
    target = create_model(preset, **overrides)
    tensors = {k: torch.from_numpy(v) for k, v in weights.items()}
    out["load_state"] = _median(lambda: target.load_state_dict(tensors), repeats)
    del target, tensors

    cfg = load_config(None, [f"model.student={preset}", f"model.vocab_size={vocab_size}",
                             f"model.num_classes={num_classes}", f"model.grid_size={grid_size}"])
    actors = [ray.remote(RolloutWorker).options(num_cpus=0.5).remote(cfg, i) for i in range(workers)]
    ray.get([a.info.remote() for a in actors])
    out["put"] = _median(lambda: ray.put(tag_weights(weights, 0)), repeats)
    version = iter(range(1, 10 ** 6))

    def object_store():
        v = next(version)
        ref = ray.put(tag_weights(weights, v))
        ray.get([a.load_weights.remote(v, ref) for a in actors])

    out["object_store"] = _median(object_store, repeats)
    port = free_port()
    plan = make_buckets({k: v.shape for k, v in weights.items()}, int(bucket_mb * 2 ** 20))
    joins = [a.join_broadcast.remote("127.0.0.1", port, i + 1, workers + 1, "gloo", plan)
             for i, a in enumerate(actors)]
    group = BroadcastGroup("127.0.0.1", port, 0, workers + 1, "gloo")
    ray.get(joins)
    state = model.state_dict()

    def broadcast():
        v = next(version)
        refs = [a.receive_weights.remote(v) for a in actors]
        group.send(state, plan)
        ray.get(refs)

    out["broadcast"] = _median(broadcast, repeats)
    for a in actors:
        ray.kill(a)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="GPT-B")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    args = p.parse_args()
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    print(json.dumps(bench(args.preset, args.workers, args.repeats, args.bucket_mb), indent=1))
    if started:
        ray.shutdown()


if __name__ == "__main__":
    main()
