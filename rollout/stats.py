"""The result of one `engine.generate` call: tokens plus per-round rollout statistics.

A *round* is one sequential model forward (the prefill counts as round 0): Cached AR needs N
rounds for N new tokens, a Jacobi engine fewer when drafts are accepted.  A Jacobi rollout
keeps its statistics round by round in a `RoundLog` (rollout/hbsjd.py `run_jacobi`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


@dataclass
class RolloutResult:
    tokens: Tensor          # (B, P + N) int64: the prefix, then the generated tokens
    prefix_len: int         # P
    committed: Tensor       # (R, B) int64 tokens committed per image per round (0 = inactive)
    accepted: Tensor        # (B,) int64 drafts accepted and committed
    rejected: Tensor        # (B,) int64 drafts rejected (the first failing draft of a round)
    active: list[int]       # (R,) images active in each round
    modes: list[str]        # (R,) execution of each round: "full" | "compact"
    wall_time: float        # seconds for the whole generate call (device synchronised)
    cpu_time: float | None = None  # its CPU seconds on a one-thread CPU (else None)
    round_times: list[float] = field(default_factory=list)  # (R,) s per round; Jacobi only
    prefills: int = 0       # prefill forwards after round 0 (slots: images admitted into rows)
    first_round: Tensor | None = None  # (B,) int64 round holding each image's prefill token
    #                                    (None = 0 for all: no slots)
    logprobs: Tensor | None = None  # (B, N) float32 behaviour log-prob of each generated token
    #                                 under the warped guided distribution it was committed
    #                                 from (rollout.sampling.token_logprob); every engine sets it
    windows: list[int] = field(default_factory=list)  # (R,) window W of each round (0: the
    #                                                   prefill; empty: not a Jacobi engine)
    engine: str = ""
    options: dict = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        """Sequential verifier forwards, the prefill included."""
        return self.committed.shape[0]

    @property
    def num_new_tokens(self) -> int:
        return self.tokens.shape[1] - self.prefix_len

    @property
    def image_rounds(self) -> Tensor:
        """(B,) int64 rounds in which each image was active."""
        return (self.committed > 0).sum(0)

    @property
    def mean_committed(self) -> float:
        """Tokens committed per image per active round (1.0 for Cached AR)."""
        return float(self.committed.sum()) / max(1, int(self.image_rounds.sum()))

    @property
    def progress(self) -> Tensor:
        """(R + 1, B) int64 committed length of every image after each round (row 0 = P)."""
        zero = torch.zeros_like(self.committed[:1])
        return self.prefix_len + torch.cat([zero, self.committed]).cumsum(0)

    def commit_histogram(self, width: int) -> list[int]:
        """Image-rounds by tokens committed: entry k counts image-rounds that committed k + 1
        tokens (k < width; larger counts land in the last entry).  Its mean is
        `mean_committed` (the prefill round counts, with the tokens its first window commits)."""
        c = self.committed[self.committed > 0].clamp(max=width) - 1
        return torch.bincount(c.cpu(), minlength=width).tolist()

    def window_histogram(self, width: int) -> list[int]:
        """Verifier rounds by window: entry W - 1 counts the rounds of window W (larger ones in
        the last entry; the W-"auto" policy's choices, rollout/window.py)."""
        out = [0] * width
        for W in self.windows:
            if W > 0:
                out[min(W, width) - 1] += 1
        return out

    @property
    def longest_single_run(self) -> Tensor:
        """(B,) int64 the longest run of consecutive verifier rounds of each image that
        committed exactly one token (a stalled image; its prefill round does not count)."""
        c = self.committed.cpu()
        first = (torch.zeros(c.shape[1], dtype=torch.long) if self.first_round is None
                 else self.first_round.cpu())
        run = torch.zeros(c.shape[1], dtype=torch.long)
        best = run.clone()
        for r in range(c.shape[0]):
            counted = (c[r] > 0) & (r > first)
            run = torch.where(counted, torch.where(c[r] == 1, run + 1, 0), run)
            best = torch.maximum(best, run)
        return best

    def summary(self) -> dict:
        """Plain-Python statistics (JSON-serialisable)."""
        return {
            "engine": self.engine, **self.options,
            "batch": int(self.tokens.shape[0]), "prefix_len": self.prefix_len,
            "new_tokens": self.num_new_tokens, "rounds": self.rounds,
            "image_rounds": self.image_rounds.tolist(),
            "mean_committed": self.mean_committed,
            "accepted": int(self.accepted.sum()), "rejected": int(self.rejected.sum()),
            "compact_rounds": sum(m == "compact" for m in self.modes),
            "windows": self.window_histogram(16),
            "prefills": self.prefills,
            "wall_time_s": self.wall_time,
        }


def normal(item):
    """`item` (a `Finished`, `Span` or `RolloutResult`) with its inference tensors replaced by
    normal copies, so that what a call hands out can be saved for backward or written in
    place outside inference mode (a learner's teacher-forced pass, a trajectory's buffers)."""
    for f in fields(item):
        value = getattr(item, f.name)
        if isinstance(value, Tensor) and value.is_inference():
            setattr(item, f.name, value.clone())
    return item


class RoundLog:
    """A Jacobi rollout's statistics round by round (round 0 = the prefill), as `RolloutResult`
    holds them: per-image counts on the device, per-round lists on the host."""

    def __init__(self, B: int, device: torch.device):
        self.times = [time.perf_counter()]     # round boundaries (each follows a device sync)
        self.away = [0.0]                      # per interval: seconds the consumer held the call
        self.committed: list[Tensor] = []      # per round (B,) int64
        self.accepted = torch.zeros(B, dtype=torch.long, device=device)
        self.rejected = torch.zeros_like(self.accepted)
        self.active: list[int] = []
        self.modes: list[str] = []
        self.windows: list[int] = []
        self.prefills = 0                      # prefill forwards after round 0
        self.first_round = torch.zeros_like(self.accepted)  # (B,) round of each image's prefill

    def prefill(self, per_image: Tensor, active: int) -> None:
        """Round 0: the prefill of the first `active` images with their first window
        (rollout/rounds.py `prefill_round`), per_image (3, B) int64 as `add`'s."""
        self.add(per_image, active, "full", 0)

    def admit(self, images: Tensor, counts: Tensor) -> None:
        """Images (k,) int64 prefilled into free rows with their first window, counts (3, k)
        int64: their tokens count in the last round."""
        self.committed[-1][images] = counts[0]
        self.accepted[images] += counts[1]
        self.rejected[images] += counts[2]
        self.first_round[images] = len(self.committed) - 1
        self.prefills += 1

    def tick(self) -> None:
        """A round boundary (after the round's device sync)."""
        self.times.append(time.perf_counter())
        self.away.append(0.0)

    def pause(self, since: float) -> None:
        """The consumer held the call from `since` until now (a streaming call's hand-out,
        between a round's sync and the next round's start): not the round's time."""
        self.away[-1] += time.perf_counter() - since

    def add(self, per_image: Tensor, active: int, mode: str, W: int) -> None:
        """A verifier round: per_image (3, B) int64 committed / accepted / rejected of each
        image, its active count, execution and window."""
        self.windows.append(W)
        self.committed.append(per_image[0])
        self.accepted += per_image[1]
        self.rejected += per_image[2]
        self.active.append(active)
        self.modes.append(mode)

    def result(self, tokens: Tensor, prefix_len: int, logprobs: Tensor) -> RolloutResult:
        """tokens (B, P + N) int64 (P = prefix_len), logprobs (B, N) float32."""
        return RolloutResult(tokens=tokens.clone(), prefix_len=prefix_len,
                             committed=torch.stack(self.committed), accepted=self.accepted,
                             rejected=self.rejected, active=self.active, modes=self.modes,
                             wall_time=0.0,
                             round_times=[b - a - p for a, b, p in
                                          zip(self.times, self.times[1:], self.away)],
                             prefills=self.prefills, first_round=self.first_round,
                             logprobs=logprobs.contiguous(), windows=list(self.windows))
