"""What a teacher worker ships: scores of the suffix positions only, top-k indices in the smallest
exact integer type, float32 values; the bytes are exactly those tensors', and every objective's
loss equals its loss on scores of every position (the layout the scores had before)."""
import pytest
import torch
import torch.nn.functional as F

from opd.distill.batch import TrajectoryBatch, index_dtype
from opd.config.schema import load_config
from opd.data import PrefixBatcher
from opd.models import create_model
from opd.models.factory import model_overrides
from opd.data.splits import open_dataset
from opd.distill.steps import (RolloutJob, build_objective, prefix_len_for, generate, score, student_loss,
                       teacher_logits)

B, K = 4, 5


@pytest.fixture(scope="module")
def setup(tiny_overrides):
    cfg = load_config("tiny", tiny_overrides)
    torch.manual_seed(0)
    teacher = create_model(cfg.model.teacher, **model_overrides(cfg)).eval()
    student = create_model(cfg.model.student, **model_overrides(cfg)).eval()
    train = open_dataset(cfg, "train")
    pb = next(PrefixBatcher(train, B, 0))
    P = prefix_len_for(0.5, train.seq_len)
    traj = generate(None, None, RolloutJob(pb.batch_id, pb.labels, pb.tokens, P, "data", 0), cfg, 0)
    return cfg, teacher, student, traj


def with_transport(cfg, transport, *objective):
    extra = [f"teacher.transport={transport}", f"teacher.topk={K if transport == 'topk' else 0}"]
    return load_config("tiny", [f"data.data_dir={cfg.data.data_dir}", *extra, *objective])


def test_index_dtype_is_the_smallest_exact_one():
    assert index_dtype(17) == torch.int16
    assert index_dtype(16384) == torch.int16            # LlamaGen's VQ-16 codebook
    assert index_dtype(32768) == torch.int16            # ids 0..32767 still fit
    assert index_dtype(32769) == torch.int32


@pytest.mark.parametrize("transport", ["topk", "full"])
def test_scores_cover_the_suffix_in_slim_types_and_count_exact_bytes(setup, transport):
    cfg, teacher, _, traj = setup
    cfg = with_transport(cfg, transport)
    L, P, V = traj.seq_len, traj.prefix_len, cfg.model.vocab_size
    assert (L, P, V) == (64, 32, 17)
    scored = score(teacher, traj, cfg.teachers[0], cfg.rollout.cfg_scale)
    assert scored.teacher_start == P
    wire = scored.to_numpy_dict()
    if transport == "topk":
        assert scored.teacher_topk_values.dtype == torch.float32
        assert scored.teacher_topk_indices.dtype == torch.int16
        assert tuple(scored.teacher_topk_values.shape) == (B, L - P, K)
        assert tuple(scored.teacher_topk_indices.shape) == (B, L - P, K)
        teacher_bytes = B * (L - P) * K * (4 + 2)
        assert wire["teacher_topk_values"].nbytes + wire["teacher_topk_indices"].nbytes == teacher_bytes
    else:
        assert scored.teacher_logprobs.dtype == torch.float32
        assert tuple(scored.teacher_logprobs.shape) == (B, L - P, V)
        teacher_bytes = B * (L - P) * V * 4
        assert wire["teacher_logprobs"].nbytes == teacher_bytes
    arrays = sum(v.nbytes for v in wire.values() if hasattr(v, "nbytes"))
    assert arrays == B * 8 + B * L * 8 + teacher_bytes              # labels, tokens, scores
    back = TrajectoryBatch.from_numpy_dict(wire)
    assert back.teacher_start == P and back.teacher_transport == transport


@pytest.mark.parametrize("transport,objective", [
    ("topk", "gkd"), ("full", "gkd"), ("topk", "kd"), ("full", "kd"),
    ("topk", "varkd"), ("full", "varkd")])
def test_losses_equal_those_on_scores_of_every_position(setup, transport, objective):
    """The slim payload changes no loss by a single bit (loss and gradient)."""
    cfg, teacher, student, traj = setup
    cfg = with_transport(cfg, transport, f"distill.objective={objective}",
                         *(["distill.lam=0.0"] if objective == "gkd" else []))
    source = {"gkd": "data", "kd": "data", "varkd": "student"}[objective]
    traj = TrajectoryBatch(traj.batch_id, traj.labels, traj.prefix_len, traj.tokens, 0, source)
    slim = score(teacher, traj, cfg.teachers[0], cfg.rollout.cfg_scale)
    logp = F.log_softmax(teacher_logits(teacher, traj, guided=cfg.teachers[0].guided,
                                        cfg_scale=cfg.rollout.cfg_scale), -1)   # (B, L, V)
    if transport == "full":
        every = traj.with_teacher(logprobs=logp)
    else:
        values, indices = logp.topk(K, dim=-1)                   # int64, every position
        every = traj.with_teacher(topk_values=values, topk_indices=indices)
    assert every.teacher_start == 0
    objective_ = build_objective(cfg)
    results = []
    for batch in (slim, every):
        student.zero_grad(set_to_none=True)
        loss, _ = student_loss(student, batch, objective_, dropout=False)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in student.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
