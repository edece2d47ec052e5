"""`StudentLearner`: one data-parallel rank of the student's DeepSpeed training group.

`learner.world_size` actors form one torch.distributed group (gloo on CPU, nccl on GPU): rank 0
picks a free port (`master_address`), every rank calls `setup(host, port)` at the same time.
Each rank wraps the starting student in a DeepSpeed engine (ZeRO stage `learner.zero_stage`,
torch AdamW as client optimizer, float32 weights with the forward in `opd.models.precision`'s
autocast (bf16 when learner.precision resolves to it), gradient clipping `learner.grad_clip`; a
step's pieces accumulate gradients up to one boundary).

`train_piece(step, version, gen, piece, ...)` takes this rank's ref of one piece of the step
from the trajectory queue as soon as the piece is there and fetches only its rows (the workers
cut each piece into the ranks' rows when they deliver it: actors/transport/delivery.py,
`opd.distill.pieces.rank_cuts`), runs forward and backward on them and accumulates the gradient;
after the step's last piece it steps the optimizer once (docs/STREAMING.md).  DeepSpeed's
gradient-accumulation boundary is set at the last piece only, so ZeRO 0-1 reduce the
accumulated gradients once and ZeRO 2-3 (which reduce at every backward) see one backward per
piece on every rank: every rank has rows in every piece (opd/distill/pieces.py).
With rollout reuse (opd/distill/reuse.py) a rank keeps a copy of its rows of every step whose
rollout is buffered (a copy: the workers that put them may die), and a step on a buffered
rollout trains on those, asking the queue nothing.  Lost with this rank only, which ends the
run anyway (its checkpoint resumes with an empty buffer or not at all).
The per-rank piece loss is `opd.distill.steps.student_loss` (the objective's token mean over the
piece's rows), scaled by R · n / N in `opd.distill.steps.backward_piece` so DeepSpeed's gradient average equals the
gradient of the global token mean; the reported loss is Σ n · loss / N over the pieces and
ranks (`opd.distill.results.combine_metrics`; the update is `opd.distill.steps.optimizer_step`,
the reference learner's).  (Exact for token-mean objectives — KD, SeqKD, GKD;
VarKD's confidence-weighted mean is combined with the same token weights, an approximation
for R > 1 and for more than one piece, the same in the reference loop.)
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from actors.transport.iostats import payload_nbytes
from actors.transport.weights import (BroadcastGroup, Bucket, free_port, make_buckets,
                                      state_dict_to_numpy, tag_weights, weights_nbytes)
from actors.workers.base import Worker
from opd.run import checkpoints as ckpt
from opd.models import precision
from opd.distill.teachers import merge_shares, run_teachers, share_from_numpy
from opd.config.schema import RunConfig
from opd.models.factory import load_role_model
from opd.distill.results import LearnerResult, PieceAnswer, combine_metrics
from opd.distill.steps import backward_piece, build_objective, make_optimizer, optimizer_step
from opd.distill.phases import learning_rate
from opd.distill.reuse import ReuseSchedule


def deepspeed_config(cfg: RunConfig, device: torch.device) -> dict:
    learner = cfg.learner
    micro = cfg.data.batch_size // learner.world_size
    return {
        "train_batch_size": micro * learner.world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        **precision.deepspeed_precision(cfg, device),      # float32 weights, bf16 autocast
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


@dataclass
class Accumulation:
    """A step this rank is accumulating gradients for, piece by piece."""
    step: int
    start: float                      # when its first piece was handed to this rank
    next: int = 0                     # the piece it takes next
    results: list[dict] = field(default_factory=list)   # each piece's metrics, in piece order
    prefetched: list = field(default_factory=list)      # payloads of the pieces still to train
    rows: int = 0
    received: int = 0                 # payload bytes fetched
    busy: float = 0.0                 # seconds of forward, backward and update
    depth: int = 0                    # queue depth when it took the step
    kept: list | None = None          # this rank's payloads of each piece, when the step's
    #                                   rollout will be buffered (opd/distill/reuse.py)


class StudentLearner(Worker):
    """One learner rank (`info`, `io_stats`: actors/workers/base.py); its `version` is the policy
    version its weights are (= learner steps done)."""
    role = "learner"

    def __init__(self, cfg: RunConfig | dict, rank: int = 0):
        super().__init__(cfg, rank)
        self.rank, self.world_size = rank, self.cfg.learner.world_size
        self.ds_engine = None
        self.autocast: torch.dtype | None = None
        self.broadcast: tuple[BroadcastGroup, list[Bucket]] | None = None
        self.steps = 0
        self.queue = None
        self.accum: Accumulation | None = None
        self.teachers = run_teachers(self.cfg)     # how a piece's shares make its target
        self.reuse = ReuseSchedule(self.cfg)       # which rollout a step trains on
        self.kept: dict[int, list] = {}            # buffered step -> this rank's piece payloads

    @property
    def version(self) -> int:
        return self.steps

    def info(self) -> dict:
        return {**super().info(), "steps": self.steps}

    def master_address(self, loopback: bool) -> tuple[str, int]:
        """(host, free port) for the group's rendezvous, chosen on this (rank 0's) node."""
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(self, host: str, port: int) -> dict:
        """Join the data-parallel group and build the DeepSpeed engine around the starting student."""
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(self.rank),
                          LOCAL_RANK="0", WORLD_SIZE=str(self.world_size))
        import deepspeed
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            # gloo does the CPU all-reduce; DeepSpeed's optional shared-memory op would be
            # JIT-compiled first, again whenever another environment built it last into
            # ~/.cache/torch_extensions (docs/FACTS.md §4)
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed("nccl" if self.device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False, distributed_port=port, verbose=False)
        student = load_role_model(self.cfg, "student", progress=False).to(self.device)
        optimizer = make_optimizer(student, self.cfg)
        self.autocast = precision.learner_autocast(self.cfg, self.device)
        self.ds_engine, *_ = deepspeed.initialize(model=student, optimizer=optimizer,
                                               config=deepspeed_config(self.cfg, self.device))
        self.ds_engine.eval()
        return self.info()

    # -- training ------------------------------------------------------------------------------

    def attach_queue(self, queue) -> bool:
        """The trajectory queue this rank takes its rows from."""
        self.queue = queue
        return True

    def train_piece(self, step: int, version: int, gen: int, piece: int, pieces: int,
                    tokens: int, prefetch: bool = False) -> PieceAnswer:
        """Forward and backward of this rank's rows of piece `piece` of `step` at policy
        `version` (docs/STREAMING.md); after the last of its `pieces` pieces, the update.  Pieces
        are taken in piece order: a piece handed out of order (after one that was lost) answers
        `skipped` and is handed again (a `PieceAnswer`, opd/distill/results.py).  `tokens`: the step's loss tokens N over every
        rank and piece; rank r's piece loss (its token mean over n rows' tokens) is scaled by
        R · n / N before backward, so DeepSpeed's gradient average over the ranks, accumulated
        over the pieces up to the accumulation boundary at the last one, is the gradient of the
        step's token mean.  `prefetch`: the step is complete in the queue; the first piece
        fetches every piece of this rank at once (a lost one re-plans the step, before any
        backward).  After the last piece the answer's `result` is this rank's `LearnerResult`:
        its metrics (loss: its rows' token mean, tokens, the on-policy check of its rows with
        the weights before this update, `opd.distill.onpolicy.KEYS`), grad_norm (global),
        seconds, busy_s (its forward, backward and update seconds), rows and bytes received.
        If a piece cannot be fetched (the worker that owned it died), every rank answers `lost`
        and keeps the pieces before it; the driver makes the piece again."""
        start = time.perf_counter()
        a = self.accum
        if piece == 0 and (a is None or a.step != step):
            a = self.accum = Accumulation(step, start)
            if step in self.reuse.kept(step):
                a.kept = []
        if a is None or a.step != step or piece != a.next:
            return PieceAnswer(self.rank, piece, skipped=True)
        last = piece == pieces - 1
        reused = self.reuse.reused(step)
        if reused and piece == 0:                     # a buffered rollout: the rows kept here
            a.prefetched = list(self.kept[self.reuse.origin(step)])
        if not a.prefetched:
            if prefetch:                              # piece 0: every piece of this rank at once
                taken = ray.get(self.queue.take.remote(step, version, self.rank))
                refs = None if taken is None else taken["refs"]
            else:
                taken = ray.get(self.queue.take_piece.remote(step, gen, piece, self.rank, version))
                refs = None if taken is None else [taken["refs"]]
            if refs is None:
                raise RuntimeError(f"learner rank {self.rank}: the queue has no admissible piece "
                                   f"{piece} of step {step} at version {version}")
            a.depth = taken["depth"]
            payloads, lost = fetch_shares(refs)
            if self._any_rank(payloads is None):
                if prefetch:                          # nothing trained yet: the step again
                    self.accum = None
                    if self.rank == 0:
                        ray.get(self.queue.drop.remote(step))
                return PieceAnswer(self.rank, piece, lost=True, lost_at=lost)
            a.received += payload_nbytes([d for cut in payloads for d in cut])
            a.prefetched = [self.io.received(cut) for cut in payloads]
        payload = a.prefetched.pop(0)
        if a.kept is not None:                        # a copy of its own: outlives its owner
            a.kept.append(copy.deepcopy(payload))
        rows = merge_shares(self.teachers, [share_from_numpy(d) for d in payload])
        fetched = time.perf_counter()
        objective = build_objective(self.cfg, step)          # the step's phase's objective
        self.ds_engine.set_gradient_accumulation_boundary(last)
        scale = self.world_size * rows.num_generated_tokens / tokens
        a.results.append(backward_piece(self.ds_engine, rows, objective, weight=scale,
                                        dropout=self.cfg.learner.student_dropout,
                                        check=self.cfg,    # the on-policy check: this version,
                                        autocast=self.autocast))   # before the update
        a.rows += rows.batch_size
        a.next += 1
        if not last:
            a.busy += time.perf_counter() - fetched
            return PieceAnswer(self.rank, piece)
        # the step leaves the queue; asked before the update and read after it, so the queue's
        # answer (a round trip, 3-4 ms here) is not on a strict step's critical path.  A step
        # that is not there fails this call, which ends the run (the update is never published).
        taken = None if prefetch or reused else self.queue.take.remote(step, version, self.rank)
        norm = optimizer_step(self.ds_engine, self.ds_engine.optimizer,    # clips, ZeRO 0-3
                              grad_clip=self.cfg.learner.grad_clip,
                              lr=learning_rate(self.cfg, self.steps))
        if taken is not None and ray.get(taken) is None:
            raise RuntimeError(f"learner rank {self.rank}: step {step} at version {version} is "
                               f"not sealed in the queue after its last piece")
        self.steps += 1
        self.accum = None
        if a.kept is not None:
            self.kept[step] = a.kept
        self.kept = {s: self.kept[s] for s in self.reuse.kept(step)}
        now = time.perf_counter()
        a.busy += now - fetched
        seconds = now - a.start
        out = LearnerResult(self.rank, combine_metrics(a.results), norm, seconds=seconds,
                            busy_s=a.busy, rows=a.rows, received_bytes=a.received,
                            queue_depth=a.depth)
        m = out.metrics
        self.metrics.report(learner_step_seconds=seconds, learner_samples=a.rows,
                            learner_samples_per_s=a.rows / seconds,
                            **({"onpolicy_logprob_delta": m["onpolicy_logprob_delta_max"]}
                               if m["onpolicy_tokens"] else {}))
        return PieceAnswer(self.rank, piece, result=out)

    def drop_step(self, step: int) -> bool:
        """Forget the pieces of `step` accumulated so far (a run interrupted before its last
        piece was made: the checkpoint is of the weights before it)."""
        if self.accum is not None and self.accum.step == step:
            self.accum = None
            self.ds_engine.zero_grad()
        return True

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any (an all-reduce over the group)."""
        if self.world_size == 1:
            return flag
        import torch.distributed as dist
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


    # -- weights -------------------------------------------------------------------------------

    def _full_parameters(self) -> contextlib.AbstractContextManager:
        """Inside it the module holds all its parameters (ZeRO-3 gathers them: every rank must
        enter it together); a no-op for ZeRO 0-2."""
        if self.ds_engine.zero_optimization_stage() == 3:
            import deepspeed
            return deepspeed.zero.GatheredParameters(list(self.ds_engine.module.parameters()),
                                                     modifier_rank=None)
        return contextlib.nullcontext()

    def get_weights(self, version: int) -> dict | None:
        """Rank 0: the full student weights, tagged {"version", "weights": flat float32 numpy
        dict}; other ranks None.  Every rank must call it (ZeRO-3 gathers collectively)."""
        with self._full_parameters():
            flat = state_dict_to_numpy(self.ds_engine.module) if self.rank == 0 else None
        return None if flat is None else tag_weights(flat, version)

    @ray.method(num_returns=2)
    def publish_weights(self, version: int) -> tuple[dict | None, int]:
        """`get_weights` and the payload's size, counted here where it is made: (tagged payload,
        bytes of its arrays) on rank 0, (None, 0) on other ranks.  Called with two return
        objects, so the driver reads the size and passes the payload's ref on to the rollout
        workers without ever fetching the weights.  Every rank must call it (ZeRO-3)."""
        payload = self.io.sent(self.get_weights(version))
        return payload, 0 if payload is None else weights_nbytes(payload["weights"])

    def bucket_plan(self) -> list[Bucket]:
        """The buckets of the collective weight broadcast (sorted names, learner.weight_bucket_mb)."""
        shapes = {k: tuple(v.shape) for k, v in self.ds_engine.module.state_dict().items()}
        return make_buckets(shapes, int(self.cfg.learner.weight_bucket_mb * 2 ** 20))

    def join_broadcast(self, host: str, port: int, size: int, backend: str) -> bool:
        """Rank 0: become the sender (member 0) of the collective weight-broadcast group."""
        self.broadcast = (BroadcastGroup(host, port, 0, size, backend), self.bucket_plan())
        return True

    def leave_broadcast(self) -> bool:
        """Drop the broadcast group (its connections close, so no member waits on it)."""
        self.broadcast = None
        return True

    def send_weights(self, version: int) -> int:
        """Broadcast the current weights (rank 0 sends; every rank must call it, ZeRO-3 gathers
        collectively).  Returns the bytes sent (0 on ranks > 0)."""
        with self._full_parameters():
            return self._send(self.ds_engine.module.state_dict())

    def _send(self, state: dict) -> int:
        if self.rank != 0:
            return 0
        if self.broadcast is None:
            raise RuntimeError("send_weights before join_broadcast")
        group, buckets = self.broadcast
        return group.send(state, buckets)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, tmp_dir: str) -> str:
        """Write this rank's part of the checkpoint being made in `tmp_dir` (step_N.tmp, see
        opd/run/checkpoints.py): DeepSpeed's files in `optimizer/` (every rank, at the same time),
        and on rank 0 the student (unwrapped, fp32, CPU) as `student.pt`.  The driver commits
        the directory once every rank has returned.  Returns `tmp_dir`."""
        self.ds_engine.save_checkpoint(tmp_dir, tag=ckpt.OPTIMIZER_DIR, save_latest=False)
        with self._full_parameters():
            if self.rank == 0:
                ckpt.write_student(tmp_dir, self.ds_engine.module.state_dict())
        return tmp_dir

    def load_checkpoint(self, path: str, step: int) -> int:
        """Restore weights and optimizer state from `path/optimizer` (DeepSpeed's files of a
        checkpoint written by save_checkpoint) after `step` learner steps; returns `step`."""
        load_path, _ = self.ds_engine.load_checkpoint(path, tag=ckpt.OPTIMIZER_DIR)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {Path(path) / ckpt.OPTIMIZER_DIR}")
        self.ds_engine.eval()
        self.steps = step
        return step


def fetch_shares(refs: list[list]) -> tuple[list[list] | None, tuple[int, ...]]:
    """The payloads of this rank's cut of each piece's shares (`refs[piece][k]`: the k-th share
    in teacher order), or (None, the positions k of the shares whose objects were lost: their
    owner died)."""
    try:
        flat = ray.get([r for cut in refs for r in cut])
    except ray.exceptions.ObjectLostError:            # OwnerDiedError: its worker died
        lost = set()
        for cut in refs:
            for k, ref in enumerate(cut):
                try:
                    ray.get(ref)
                except ray.exceptions.ObjectLostError:
                    lost.add(k)
        return None, tuple(sorted(lost))
    out, i = [], 0
    for cut in refs:
        out.append(flat[i:i + len(cut)])
        i += len(cut)
    return out, ()

