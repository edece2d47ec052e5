"""The payload byte counter of the scale dry run (actors/transport/iostats.py): exact byte counts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.transport.iostats import IOCounter, payload_nbytes, peak_rss_bytes


@dataclass
class Job:
    labels: torch.Tensor
    note: str


def test_payload_nbytes_counts_array_bytes_exactly():
    payload = {"tokens": np.zeros((2, 3), np.int64),                 # 48
               "values": np.zeros((2, 3, 4), np.float32),            # 96
               "indices": torch.zeros(2, 3, 4, dtype=torch.int16),   # 48
               "nested": [np.zeros(5, np.uint8), (torch.zeros(3),)],  # 5 + 12
               "job": Job(torch.zeros(7, dtype=torch.int64), "x"),    # 56
               "batch_id": 3, "source": "student", "hist": [1, 2, 3], "none": None}
    assert payload_nbytes(payload) == 48 + 96 + 48 + 5 + 12 + 56
    assert payload_nbytes({"weights": {"w": np.ones((16, 8), np.float32)}, "version": 2}) == 512
    assert payload_nbytes(None) == 0 and payload_nbytes(Job) == 0    # a class is not a payload


def test_counter_returns_its_argument_and_accumulates():
    io = IOCounter()
    a, b = {"x": np.zeros(10, np.float64)}, [np.zeros(3, np.int16)]
    assert io.received(a) is a and io.received(a) is a
    assert io.sent(b) is b
    s = io.stats()
    assert set(s) == {"received_bytes", "sent_bytes", "peak_rss_bytes"}
    assert (s["received_bytes"], s["sent_bytes"]) == (160, 6)
    # ru_maxrss is KiB on Linux: a running Python with numpy and torch holds well over 10 MiB
    assert peak_rss_bytes() >= s["peak_rss_bytes"] > 10 * 2 ** 20
