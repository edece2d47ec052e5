"""Bytes a role receives and sends, and its peak memory: one small counter per actor.

    self.io = IOCounter()                      # in the actor's __init__
    self.io.received(parts)                    # where a payload arrives
    return self.io.sent(out)                   # where a payload leaves (returns it unchanged)
    def io_stats(self) -> dict:                # the actor method the benches call
        return self.io.stats()                 # {received_bytes, sent_bytes, peak_rss_bytes}

A payload's bytes are its arrays' bytes (`payload_nbytes`): numpy `nbytes` and torch
`numel · element_size`, summed through dicts, lists, tuples and dataclasses; scalars, strings
and object refs count 0.  So a trajectory's `to_numpy_dict()` counts its token and teacher
arrays, a tagged weights payload counts `actors.transport.weights.weights_nbytes` of its flat dict, and a
`QueueItem` (refs only) counts 0.  Peak memory is the process's `ru_maxrss` (Linux reports KiB;
converted to bytes); it includes the object-store pages the process has read (shared memory).
"""
from __future__ import annotations

import dataclasses
import resource
import sys
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def payload_nbytes(obj: Any) -> int:
    """Array bytes in `obj` (numpy arrays and torch tensors inside dicts, lists, tuples and
    dataclass fields); 0 for anything else."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, dict):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class IOCounter:
    """Running totals of the payload bytes one actor received and sent."""

    def __init__(self) -> None:
        self.received_bytes = 0
        self.sent_bytes = 0

    def received(self, payload: T) -> T:
        self.received_bytes += payload_nbytes(payload)
        return payload

    def sent(self, payload: T) -> T:
        self.sent_bytes += payload_nbytes(payload)
        return payload

    def put(self, nbytes: int) -> None:
        """Payload bytes this actor put into the object store for another role (counted where
        they were made: a delivered part's `PartReport.nbytes`)."""
        self.sent_bytes += int(nbytes)

    def stats(self) -> dict:
        """{received_bytes, sent_bytes, peak_rss_bytes} since the actor started."""
        return {"received_bytes": self.received_bytes, "sent_bytes": self.sent_bytes,
                "peak_rss_bytes": peak_rss_bytes()}
