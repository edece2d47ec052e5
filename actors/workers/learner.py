"""`StudentLearner`: one data-parallel rank of the student's DeepSpeed training group.

`learner.world_size` actors form one torch.distributed group (gloo on CPU, nccl on GPU): rank 0
picks a free port (`master_address`), every rank calls `setup(host, port)` at the same time.
Each rank wraps the starting student in a DeepSpeed engine (ZeRO stage `learner.zero_stage`,
torch AdamW as client optimizer, float32 weights with the forward in `opd.precision`'s
autocast (bf16 when learner.precision resolves to it), gradient clipping
`learner.grad_clip`, micro batch = global batch / world size, no gradient accumulation).

`train_step(step, version)` takes this rank's refs of the step's batch from the trajectory
queue and fetches only its rows, `shard_rows(B, R)[rank]` (the workers cut each part into the
ranks' pieces when they deliver it: actors/transport/delivery.py), merged in row order.
The per-rank loss is `opd.steps.student_loss` (the objective's token mean over the shard),
scaled by R · n_r / N before backward so DeepSpeed's gradient average equals the gradient of
the global token mean; the reported loss is Σ_r n_r · loss_r / N, which the driver forms from
the ranks' results (`actors.driver.core.combine_rank_metrics`).  (Exact for token-mean objectives —
KD, SeqKD, GKD; VarKD's confidence-weighted mean is combined with the same token weights, an
approximation for R > 1.)
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import ray
import torch

from actors.transport.iostats import payload_nbytes
from actors.transport.shards import merge_batches
from actors.transport.weights import (BroadcastGroup, Bucket, free_port, make_buckets,
                                      state_dict_to_numpy, tag_weights, weights_nbytes)
from actors.workers.base import Worker
from opd import checkpoints as ckpt
from opd import precision
from opd.batch import TrajectoryBatch
from opd.config import RunConfig
from opd.onpolicy import KEYS as ONPOLICY_KEYS
from opd.pretrain import load_role_model
from opd.steps import (build_objective, learning_rate, make_optimizer, set_learning_rate,
                       student_loss)


def deepspeed_config(cfg: RunConfig, device: torch.device) -> dict:
    lr = cfg.learner
    micro = cfg.data.batch_size // lr.world_size
    return {
        "train_batch_size": micro * lr.world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": lr.grad_clip,
        "zero_optimization": {"stage": lr.zero_stage},
        **precision.deepspeed_precision(cfg, device),      # float32 weights, bf16 autocast
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


class StudentLearner(Worker):
    """One learner rank (`info`, `io_stats`: actors/workers/base.py); its `version` is the policy
    version its weights are (= learner steps done)."""
    role = "learner"

    def __init__(self, cfg: RunConfig | dict, rank: int = 0):
        super().__init__(cfg, rank)
        self.rank, self.world_size = rank, self.cfg.learner.world_size
        self.engine = None
        self.autocast: torch.dtype | None = None
        self.broadcast: tuple[BroadcastGroup, list[Bucket]] | None = None
        self.steps = 0
        self.queue = None

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
        self.engine, *_ = deepspeed.initialize(model=student, optimizer=optimizer,
                                               config=deepspeed_config(self.cfg, self.device))
        self.engine.eval()
        return self.info()

    # -- training ------------------------------------------------------------------------------

    def _grad_norm(self) -> float | None:
        """Pre-clip global gradient norm where DeepSpeed does not record one (ZeRO 0, fp32)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])))

    def attach_queue(self, queue) -> bool:
        """The trajectory queue this rank takes its rows from."""
        self.queue = queue
        return True

    def train_step(self, step: int, version: int) -> dict:
        """One optimizer step on this rank's rows of `step`'s batch at policy `version`: takes
        its refs from the trajectory queue and fetches only its own pieces (actors/transport/delivery.py).
        Returns this rank's metrics: loss (its shard's), tokens, grad_norm (global), seconds,
        rows and bytes received, the on-policy check of its shard with the weights before this
        update (`opd.onpolicy.KEYS`).  If a rank cannot fetch its pieces (the worker that owned them
        died), every rank returns {"lost": True} without training and the driver makes the
        step's parts again."""
        start = time.perf_counter()
        share = ray.get(self.queue.take.remote(step, version, self.rank))
        if share is None:
            raise RuntimeError(f"learner rank {self.rank}: the queue has no admissible batch for "
                               f"step {step} at version {version}")
        try:
            payloads = ray.get(share["refs"])
        except ray.exceptions.ObjectLostError:        # OwnerDiedError: its worker died
            payloads = None
        if self._any_rank(payloads is None):
            if self.rank == 0:
                ray.get(self.queue.drop.remote(step))
            return {"rank": self.rank, "lost": True}
        shard = merge_batches([TrajectoryBatch.from_numpy_dict(p) for p in self.io.received(payloads)])
        objective = build_objective(self.cfg, step)          # the step's phase's objective
        loss, metrics = student_loss(self.engine, shard, objective,         # + on-policy check:
                                     dropout=self.cfg.learner.student_dropout, check=self.cfg,
                                     autocast=self.autocast)
        gap = {k: metrics.pop(k) for k in ONPOLICY_KEYS}       # this version, before the update
        scale = self.world_size * shard.num_generated_tokens / share["generated_tokens"]
        self.engine.backward(loss * scale if scale != 1.0 else loss)
        set_learning_rate(self.engine.optimizer, learning_rate(self.cfg, self.steps))
        norm = self._grad_norm() if self.engine.zero_optimization_stage() == 0 else None
        self.engine.step()
        if norm is None:
            g = self.engine.get_global_grad_norm()
            norm = float(g) if g is not None else float("nan")
        self.engine.eval()
        self.steps += 1
        seconds = time.perf_counter() - start
        self.metrics.report(learner_step_seconds=seconds, learner_samples=shard.batch_size,
                            learner_samples_per_s=shard.batch_size / seconds,
                            **({"onpolicy_logprob_delta": gap["onpolicy_logprob_delta_max"]}
                               if gap["onpolicy_tokens"] else {}))
        return {**metrics, **gap, "rank": self.rank, "loss": float(loss.detach()),
                "tokens": float(shard.num_generated_tokens), "grad_norm": norm,
                "seconds": seconds, "rows": shard.batch_size,
                "received_bytes": payload_nbytes(payloads), "queue_depth": share["depth"]}

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
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed
            return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()),
                                                     modifier_rank=None)
        return contextlib.nullcontext()

    def get_weights(self, version: int) -> dict | None:
        """Rank 0: the full student weights, tagged {"version", "weights": flat float32 numpy
        dict}; other ranks None.  Every rank must call it (ZeRO-3 gathers collectively)."""
        with self._full_parameters():
            flat = state_dict_to_numpy(self.engine.module) if self.rank == 0 else None
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
        shapes = {k: tuple(v.shape) for k, v in self.engine.module.state_dict().items()}
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
            return self._send(self.engine.module.state_dict())

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
        opd/checkpoints.py): DeepSpeed's files in `optimizer/` (every rank, at the same time),
        and on rank 0 the student (unwrapped, fp32, CPU) as `student.pt`.  The driver commits
        the directory once every rank has returned.  Returns `tmp_dir`."""
        self.engine.save_checkpoint(tmp_dir, tag=ckpt.OPTIMIZER_DIR, save_latest=False)
        with self._full_parameters():
            if self.rank == 0:
                ckpt.write_student(tmp_dir, self.engine.module.state_dict())
        return tmp_dir

    def load_checkpoint(self, path: str, step: int) -> int:
        """Restore weights and optimizer state from `path/optimizer` (DeepSpeed's files of a
        checkpoint written by save_checkpoint) after `step` learner steps; returns `step`."""
        load_path, _ = self.engine.load_checkpoint(path, tag=ckpt.OPTIMIZER_DIR)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {Path(path) / ckpt.OPTIMIZER_DIR}")
        self.engine.eval()
        self.steps = step
        return step
