"""`TrajectoryBatch`: the one typed container that travels between roles.

rollout worker → (tokens, rollout stats) → teacher worker → (+ teacher scores) → learner.

Layout: `tokens[:, :prefix_len]` is the real prefix (from data), `tokens[:, prefix_len:]` the
generated suffix (by the student, the teacher, or taken from data, see `source`).  Losses are
taken on the suffix positions (`loss_mask`).  Position i of `tokens` is image token i.  Teacher
scores cover either every position (S = L rows per sequence) or, as `opd.distill.steps.score` ships
them, the suffix only (S = N = L − P): row j of a per-position teacher tensor is the teacher's
distribution of token `teacher_start + j` given the class label and the tokens before it
(`teacher_start` is 0 or P).  Top-k indices travel in the smallest integer type that holds
every token id of the vocabulary (`index_dtype`: int16 up to 32,768 tokens, else int32; int64 is
accepted too); losses widen them to int64.

`behaviour_logprobs` (B, N) float32, suffix only: the log-prob of each generated token under
the warped guided distribution the rollout committed it from (`rollout.sampling.token_logprob`;
for greedy decoding the same distribution's log-prob of the argmax).  Only student rollouts
carry it (source "student"); the learner recomputes it with its own weights to prove the step
on-policy (`opd/distill/onpolicy.py`).  4 · B · N bytes: 8 KiB a step at the digits shape (B 32,
N 64), 36 KiB at the paper's (B 32, L 576, P 288).

In memory the batch holds torch tensors.  On the wire (`to_numpy_dict()` /
`from_numpy_dict()`) it is a flat dict of numpy arrays and Python scalars, which Ray's object
store ships zero-copy to readers on the same node.  The tensors that `from_numpy_dict` builds
share memory with the arrays (read-only when they come from the object store: copy before
writing in place, or pass `copy=True`).  The round trip is exact (values, dtypes, shapes).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from opd.distill.rollout_stats import RolloutStats

SOURCES = ("student", "data", "teacher")
STATS_PREFIX = "rollout_stats/"
_TENSOR_FIELDS = ("labels", "tokens", "teacher_logprobs", "teacher_topk_values", "teacher_topk_indices",
                  "behaviour_logprobs")

Stat = int | float | str | bool | list[int]
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


def index_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer type that holds every token id 0..vocab_size − 1 exactly: int16
    up to 32,768 tokens (LlamaGen's 16,384 included), else int32."""
    return torch.int16 if vocab_size - 1 <= torch.iinfo(torch.int16).max else torch.int32


@dataclass
class TrajectoryBatch:
    """A batch of B image-token sequences of length L = P + N and their teacher scores.

    batch_id: int, id of the prefix batch this came from (consumed exactly once).
    labels: (B,) int64 class labels.
    prefix_len: int P, real prefix tokens per sequence (0 <= P <= L).
    tokens: (B, L) int64 image tokens, real prefix then generated suffix.
    policy_version: int, version of the student weights that generated the suffix.
    source: "student" (on-policy rollout), "data" (suffix from the dataset) or "teacher"
        (teacher-generated suffix, SeqKD).
    rollout_stats: `RolloutStats` of the rollout (rounds, mean committed tokens, seconds,
        engine name, committed-tokens histogram, ...; opd/distill/rollout_stats.py).
    teacher_logprobs: (B, S, V) float full-vocabulary teacher log-probs, or None.
    teacher_topk_values: (B, S, k) float teacher log-probs (normalized over the full
        vocabulary) at its k most likely tokens, or None.
    teacher_topk_indices: (B, S, k) int16 / int32 / int64 token ids of those values, or None.
    S is L (every position) or L − P (the suffix only, see `teacher_start`).  At most one
    teacher transport (full or top-k) is present.
    behaviour_logprobs: (B, L − P) float32 log-prob of each suffix token under the rollout's
        warped guided distribution (student rollouts only), or None.
    """

    batch_id: int
    labels: Tensor
    prefix_len: int
    tokens: Tensor
    policy_version: int = 0
    source: str = "student"
    rollout_stats: RolloutStats = field(default_factory=RolloutStats)
    teacher_logprobs: Tensor | None = None
    teacher_topk_values: Tensor | None = None
    teacher_topk_indices: Tensor | None = None
    behaviour_logprobs: Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be (B, L) int64, got {tuple(self.tokens.shape)} {self.tokens.dtype}")
        B, L = self.tokens.shape
        if self.labels.shape != (B,) or self.labels.dtype != torch.int64:
            raise ValueError(f"labels must be (B,) = ({B},) int64, got {tuple(self.labels.shape)} {self.labels.dtype}")
        if not 0 <= self.prefix_len <= L:
            raise ValueError(f"prefix_len must lie in [0, L={L}], got {self.prefix_len}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if not isinstance(self.rollout_stats, RolloutStats):
            raise ValueError(f"rollout_stats must be an opd.distill.rollout_stats.RolloutStats, "
                             f"got {type(self.rollout_stats).__name__}")
        full = self.teacher_logprobs
        vals, idx = self.teacher_topk_values, self.teacher_topk_indices
        rows = ((B, L), (B, L - self.prefix_len))          # every position, or the suffix
        if full is not None:
            if full.dim() != 3 or full.shape[:2] not in rows or not full.is_floating_point():
                raise ValueError(f"teacher_logprobs must be (B, L, V) or (B, L - P, V) float with "
                                 f"(B, L, P) = {(B, L, self.prefix_len)}, got {tuple(full.shape)} {full.dtype}")
        if (vals is None) != (idx is None):
            raise ValueError("teacher_topk_values and teacher_topk_indices come together (both or neither)")
        if vals is not None:
            if vals.dim() != 3 or vals.shape[:2] not in rows or idx.shape != vals.shape:
                raise ValueError(f"teacher top-k values and indices must both be (B, L, k) or "
                                 f"(B, L - P, k) with (B, L, P) = {(B, L, self.prefix_len)}, got "
                                 f"{tuple(vals.shape)} and {tuple(idx.shape)}")
            if not vals.is_floating_point() or idx.dtype not in INDEX_DTYPES:
                raise ValueError(f"teacher top-k values must be float and indices one of "
                                 f"{INDEX_DTYPES}, got {vals.dtype}, {idx.dtype}")
            if full is not None:
                raise ValueError("a batch carries one teacher transport: full log-probs or top-k, not both")
        lp = self.behaviour_logprobs
        if lp is not None and (lp.shape != (B, L - self.prefix_len) or lp.dtype != torch.float32):
            raise ValueError(f"behaviour_logprobs must be (B, L - P) = {(B, L - self.prefix_len)} "
                             f"float32, got {tuple(lp.shape)} {lp.dtype}")

    # -- shape helpers -------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        """L = P + N image tokens per sequence."""
        return self.tokens.shape[1]

    @property
    def num_generated_tokens(self) -> int:
        """B · N, the number of suffix (loss) positions in the batch."""
        return self.batch_size * (self.seq_len - self.prefix_len)

    @property
    def loss_mask(self) -> Tensor:
        """(B, L) bool, true at the generated positions i >= prefix_len."""
        pos = torch.arange(self.seq_len, device=self.tokens.device)
        return (pos >= self.prefix_len).expand(self.batch_size, -1)

    @property
    def teacher_start(self) -> int:
        """The position of row 0 of the teacher tensors: 0 when they cover every position,
        P when they cover the suffix only (also 0 without teacher scores)."""
        t = self.teacher_logprobs if self.teacher_logprobs is not None else self.teacher_topk_values
        return 0 if t is None or t.shape[1] == self.seq_len else self.prefix_len

    @property
    def teacher_transport(self) -> str | None:
        """"full", "topk", or None when the batch has no teacher scores yet."""
        if self.teacher_logprobs is not None:
            return "full"
        if self.teacher_topk_values is not None:
            return "topk"
        return None

    def with_teacher(
        self,
        logprobs: Tensor | None = None,
        topk_values: Tensor | None = None,
        topk_indices: Tensor | None = None,
    ) -> TrajectoryBatch:
        """A copy carrying the given teacher scores (replacing any present); tensors are shared."""
        return dataclasses.replace(
            self, rollout_stats=self.rollout_stats.copy(), teacher_logprobs=logprobs,
            teacher_topk_values=topk_values, teacher_topk_indices=topk_indices,
        )

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        """A copy with every tensor on `device`."""
        moved = {name: None if getattr(self, name) is None else getattr(self, name).to(device)
                 for name in _TENSOR_FIELDS}
        return dataclasses.replace(self, rollout_stats=self.rollout_stats.copy(), **moved)

    def _scalars(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "prefix_len": self.prefix_len,
                "policy_version": self.policy_version, "source": self.source}

    # -- numpy dict (Ray object store) ---------------------------------------------------------

    def to_numpy_dict(self) -> dict[str, Any]:
        """Flat dict: the batch scalars, one numpy array per present tensor field (sharing memory
        with CPU tensors), and `rollout_stats/<field>` per stat that is set."""
        out: dict[str, Any] = self._scalars()
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = _to_numpy(name, value)
        for key, value in self.rollout_stats.to_dict().items():
            out[STATS_PREFIX + key] = value
        return out

    @classmethod
    def from_numpy_dict(cls, d: dict[str, Any], copy: bool = False) -> TrajectoryBatch:
        """Inverse of `to_numpy_dict`; tensors share memory with the arrays unless `copy`."""
        tensors = {name: _to_tensor(d[name], copy) for name in _TENSOR_FIELDS if d.get(name) is not None}
        stats = {k[len(STATS_PREFIX):]: _py(v) for k, v in d.items() if k.startswith(STATS_PREFIX)}
        return cls(batch_id=int(d["batch_id"]), prefix_len=int(d["prefix_len"]),
                   policy_version=int(d["policy_version"]), source=str(d["source"]),
                   rollout_stats=RolloutStats.from_dict(stats), **tensors)


def _to_numpy(name: str, t: Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise ValueError(f"{name} is bfloat16, which numpy cannot hold: cast to float32 before shipping")
    return t.detach().cpu().contiguous().numpy()


def _to_tensor(a: np.ndarray, copy: bool) -> Tensor:
    a = np.asarray(a)
    if copy or not a.flags.c_contiguous:
        return torch.from_numpy(np.array(a, order="C", copy=True))
    if not a.flags.writeable:  # object-store buffers: share them, read-only by contract
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    return torch.from_numpy(a)


def _py(v: Any) -> Stat:
    """numpy scalar / array -> Python scalar / list (Ray may hand back numpy types)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_py(x) for x in v]
    return v.item() if isinstance(v, np.generic) else v
