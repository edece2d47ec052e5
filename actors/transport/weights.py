"""Student weights from the learner to the rollout workers, once per policy version.

Object-store path (default, any cluster): the learner's rank 0 returns the full state dict as a
flat dict of float32 numpy arrays tagged with its version (`tag_weights`); that return value is
ONE object in the store, owned by the driver (`publish_weights` is the same for a dict the
driver holds), and every rollout worker reads it zero-copy (same node) and checks the tag before
generating at that version.  Never one RPC per parameter.  The learner also counts the
payload's bytes (`StudentLearner.publish_weights`: a second, tiny return object), so the driver
passes the payload's ref on without ever fetching the weights.

Collective path (`learner.weight_sync=collective`): learner rank 0 and the rollout workers form
a broadcast group of their own (nccl on GPUs, gloo on CPUs), outside the learner's
data-parallel group; parameters travel in flat buckets of `learner.weight_bucket_mb`.
"""
from __future__ import annotations

import datetime
import socket
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch import Tensor

Weights = dict[str, np.ndarray]
"""A flat state dict: parameter name -> float32 numpy array (C-contiguous)."""


def state_dict_to_numpy(model_or_state: torch.nn.Module | dict[str, Tensor]) -> Weights:
    """Flat dict of float32 numpy arrays (copies, detached from the live parameters)."""
    state = (model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module)
             else model_or_state)
    return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in state.items()}


def weights_nbytes(weights: Weights) -> int:
    return int(sum(a.nbytes for a in weights.values()))


def tag_weights(weights: Weights, version: int) -> dict:
    """The wire object of one policy version: {"version": v, "weights": flat dict}."""
    return {"version": int(version), "weights": weights}


def untag_weights(payload: dict, version: int) -> Weights:
    """The flat dict of a tagged payload, after checking it is the version the caller expects."""
    if int(payload["version"]) != int(version):
        raise ValueError(f"weights tagged version {payload['version']} were sent as version {version}")
    return payload["weights"]


def publish_weights(weights: Weights, version: int) -> PublishedWeights:
    """One `ray.put` of the tagged flat dict (for weights the driver holds)."""
    start = time.perf_counter()
    ref = ray.put(tag_weights(weights, version))
    return PublishedWeights(version, ref, weights_nbytes(weights), time.perf_counter() - start)


@torch.no_grad()
def load_numpy_weights(model: torch.nn.Module, weights: Weights) -> None:
    """Copy a flat numpy state dict into `model` (strict: same keys and shapes), casting to the
    model's dtype and device.  The arrays may be read-only object-store buffers."""
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(weights)), sorted(set(weights) - set(state))
    if missing or unexpected:
        raise KeyError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch warns on read-only numpy buffers
        for name, target in state.items():
            src = torch.from_numpy(np.asarray(weights[name]))
            if src.shape != target.shape:
                raise ValueError(f"weights[{name!r}] has shape {tuple(src.shape)}, the model "
                                 f"expects {tuple(target.shape)}")
            target.copy_(src)


@dataclass
class PublishedWeights:
    """One policy version in the object store: `ref` is the flat numpy dict, one object."""
    version: int
    ref: ray.ObjectRef          # the tagged payload {"version", "weights"}
    nbytes: int = 0
    seconds: float = 0.0        # learner gather + put
    loaded_by: set[int] = field(default_factory=set)


# ----------------------------------------------------------------------------------------------
# Collective broadcast (nccl on GPUs, gloo on CPUs)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bucket:
    """Consecutive parameters flattened into one buffer of `numel` elements."""
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int


def make_buckets(shapes: dict[str, tuple[int, ...]], bucket_bytes: int,
                 itemsize: int = 4) -> list[Bucket]:
    """Group parameters (in sorted-name order, so every member agrees) into buckets of at most
    `bucket_bytes` (a larger single parameter gets a bucket of its own)."""
    buckets, names, sizes, numel = [], [], [], 0
    for name in sorted(shapes):
        n = int(np.prod(shapes[name], dtype=np.int64))
        if names and (numel + n) * itemsize > bucket_bytes:
            buckets.append(Bucket(tuple(names), tuple(sizes), numel))
            names, sizes, numel = [], [], 0
        names.append(name)
        sizes.append(tuple(shapes[name]))
        numel += n
    if names:
        buckets.append(Bucket(tuple(names), tuple(sizes), numel))
    return buckets


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastGroup:
    """A process group of its own: rank 0 (learner rank 0) sends, ranks 1.. (rollout workers)
    receive.  Built straight from a TCPStore, so its members need not share any default group
    (the learner already has one for data parallelism)."""

    def __init__(self, host: str, port: int, rank: int, size: int, backend: str,
                 timeout_s: float = 120.0):
        self.rank, self.size, self.backend = rank, size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore("opd-weights", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, size, timeout)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"broadcast backend must be 'nccl' or 'gloo', got {backend!r}")

    def _broadcast(self, buf: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([buf], opts).wait()

    @torch.no_grad()
    def send(self, state: dict[str, Tensor], buckets: list[Bucket]) -> int:
        """Rank 0: broadcast `state` bucket by bucket; returns the bytes sent."""
        sent = 0
        for b in buckets:
            buf = torch.cat([state[n].detach().reshape(-1).to(self.device, torch.float32)
                             for n in b.names])
            self._broadcast(buf)
            sent += buf.numel() * buf.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sent

    @torch.no_grad()
    def receive(self, model: torch.nn.Module, buckets: list[Bucket]) -> int:
        """Ranks >= 1: receive every bucket into `model`'s parameters; returns bytes received."""
        state = model.state_dict()
        got = 0
        for b in buckets:
            buf = torch.empty(b.numel, dtype=torch.float32, device=self.device)
            self._broadcast(buf)
            offset = 0
            for name, shape in zip(b.names, b.shapes):
                n = int(np.prod(shape, dtype=np.int64))
                state[name].copy_(buf[offset:offset + n].view(shape))
                offset += n
            got += buf.numel() * buf.element_size()
        return got
