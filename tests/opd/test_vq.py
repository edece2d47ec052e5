"""VQ-16 tokenizer: LlamaGen state-dict layout, strict loading, decode shapes; digits codec."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from opd.data import DataError
from opd.models.safe_load import CheckpointError
from opd.models.vq import AttnBlock, DigitsDecoder, VQModel, create_vq16, load_vq_checkpoint, to_uint8

# Small enough for CPU tests; ch_mult keeps LlamaGen's 5 levels (16× up-sampling), GroupNorm(32) needs ch >= 32.
TINY = dict(ch=32, z_channels=32, codebook_size=64, codebook_used_size=16)


@pytest.fixture(scope="module")
def full_shapes() -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = VQModel()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_official_key_names_and_shapes(full_shapes):
    s = full_shapes
    assert s["quantize.embedding.weight"] == (16384, 8)
    assert s["quantize.codebook_used"] == (65536,)
    assert s["post_quant_conv.weight"] == (256, 8, 1, 1)
    assert s["quant_conv.weight"] == (8, 256, 1, 1)
    assert s["decoder.conv_in.weight"] == (512, 256, 3, 3)
    assert s["decoder.mid.0.conv1.weight"] == (512, 512, 3, 3)
    assert s["decoder.mid.1.q.weight"] == (512, 512, 1, 1)
    assert s["decoder.mid.2.norm2.weight"] == (512,)
    assert s["decoder.conv_blocks.0.attn.2.proj_out.weight"] == (512, 512, 1, 1)
    assert s["decoder.conv_blocks.1.res.0.nin_shortcut.weight"] == (256, 512, 1, 1)
    assert s["decoder.conv_blocks.3.res.0.conv1.weight"] == (128, 256, 3, 3)
    assert s["decoder.conv_blocks.4.res.2.conv2.weight"] == (128, 128, 3, 3)
    assert s["decoder.norm_out.weight"] == (128,)
    assert s["decoder.conv_out.weight"] == (3, 128, 3, 3)
    assert s["encoder.conv_in.weight"] == (128, 3, 3, 3)
    assert s["encoder.conv_blocks.4.attn.1.k.weight"] == (512, 512, 1, 1)
    assert s["encoder.conv_out.weight"] == (256, 512, 3, 3)
    # Structure: 3 res blocks per up level, attention only at the lowest resolution, no upsample at the top.
    for b in range(5):
        assert f"decoder.conv_blocks.{b}.res.2.conv1.weight" in s
        assert f"decoder.conv_blocks.{b}.res.3.conv1.weight" not in s
        assert (f"decoder.conv_blocks.{b}.attn.0.q.weight" in s) == (b == 0)
        assert (f"decoder.conv_blocks.{b}.upsample.conv.weight" in s) == (b < 4)
        assert (f"encoder.conv_blocks.{b}.attn.0.q.weight" in s) == (b == 4)
        assert (f"encoder.conv_blocks.{b}.downsample.conv.weight" in s) == (b < 4)
        assert f"encoder.conv_blocks.{b}.res.2.conv1.weight" not in s
    assert "decoder.conv_blocks.0.attn.3.q.weight" not in s
    n_params = sum(torch.Size(v).numel() for k, v in s.items() if k != "quantize.codebook_used")
    assert 71.5e6 < n_params < 72.5e6  # LlamaGen's VQ-16: 72M parameters


def _random_state(model: VQModel, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in model.state_dict().items()}


def test_checkpoint_loads_strictly_and_decodes(tmp_path):
    src = create_vq16(**TINY)
    state = _random_state(src, 0)
    src.load_state_dict(state)
    path = tmp_path / "vq.pt"
    torch.save({"model": state, "steps": 7, "args": argparse.Namespace(vq_model="VQ-16")}, path)

    model = load_vq_checkpoint(str(path), **TINY)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    codes = torch.randint(0, 64, (2, 4))
    images = model.decode_codes(codes)
    assert images.shape == (2, 3, 32, 32)
    assert torch.equal(images, src.eval().decode_codes(codes))
    assert model.decode_codes(torch.randint(0, 64, (1, 6)), grid=(2, 3)).shape == (1, 3, 32, 48)
    with pytest.raises(ValueError, match="square grid"):
        model.decode_codes(torch.zeros(1, 6, dtype=torch.long))


def test_checkpoint_key_mismatch_is_named(tmp_path):
    state = _random_state(create_vq16(**TINY), 1)
    del state["quantize.codebook_used"]  # tolerated: training bookkeeping only
    ok = tmp_path / "ok.pt"
    torch.save({"model": state}, ok)
    load_vq_checkpoint(str(ok), **TINY)

    del state["decoder.conv_out.bias"]
    state["decoder.extra.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)  # bare state dict
    with pytest.raises(CheckpointError, match=r"decoder\.conv_out\.bias.*decoder\.extra\.weight"):
        load_vq_checkpoint(str(bad), **TINY)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_vq_checkpoint(str(tmp_path / "missing.pt"), **TINY)


def nearest(model: VQModel, z: torch.Tensor) -> torch.Tensor:
    """z (B, D, h, w) → codes (B, h·w) int64 of the nearest normalized code (cosine): the
    encode side of the codebook, which opd never runs (it only decodes samples)."""
    zf = F.normalize(z.permute(0, 2, 3, 1).flatten(1, 2), p=2, dim=-1)   # (B, h·w, D)
    return (zf @ model.quantize.codebook().T).argmax(dim=-1)


def test_codebook_lookup_is_normalized_raster_order():
    model = create_vq16(**TINY)
    codes = torch.tensor([[3, 1, 4, 1, 5, 9]])
    z = model.quantize.lookup(codes, 2, 3)  # (1, 8, 2, 3)
    e = model.quantize.embedding.weight
    for i in range(2):
        for j in range(3):
            want = e[codes[0, 3 * i + j]] / e[codes[0, 3 * i + j]].norm()
            torch.testing.assert_close(z[0, :, i, j], want)
    # A normalized code vector's nearest code is itself.
    all_codes = torch.arange(64).reshape(1, 64)
    assert torch.equal(nearest(model, model.quantize.lookup(all_codes, 8, 8)), all_codes)
    with torch.no_grad():                               # the encoder down-samples 16x
        z = model.quant_conv(model.encoder(torch.randn(2, 3, 32, 32)))
    assert nearest(model, z).shape == (2, 4)


def test_attention_matches_llamagen_formula():
    torch.manual_seed(0)
    block = AttnBlock(32).double()
    x = torch.randn(2, 32, 3, 4, dtype=torch.float64)
    h = block.norm(x)
    q, k, v = (m(h).reshape(2, 32, 12) for m in (block.q, block.k, block.v))
    w = F.softmax(torch.bmm(q.permute(0, 2, 1), k) * 32 ** -0.5, dim=2)  # (B, HW_q, HW_k)
    want = x + block.proj_out(torch.bmm(v, w.permute(0, 2, 1)).reshape(2, 32, 3, 4))
    torch.testing.assert_close(block(x), want)


def test_to_uint8():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0])
    assert to_uint8(x).tolist() == [0, 0, 128, 191, 255, 255]
    assert to_uint8(x).dtype == torch.uint8


def test_digits_decoder_is_exact_inverse():
    tokens = torch.arange(17).repeat(16)[:256].reshape(1, 256)
    dec = DigitsDecoder(16)
    images = dec.decode_uint8(tokens)
    assert images.shape == (1, 3, 16, 16) and images.dtype == torch.uint8
    want = [int(t * 255 / 16 + 0.5) for t in tokens[0].tolist()]
    assert images[0, 0].flatten().tolist() == want and torch.equal(images[0, 0], images[0, 2])
    assert [want[0], want[8], want[16]] == [0, 128, 255]
    x = dec.decode_codes(tokens)
    assert x.shape == (1, 3, 16, 16) and x.min() == -1.0 and x.max() == 1.0
    assert torch.equal(to_uint8(x), images)
    with pytest.raises(DataError, match=r"\[0, 17\)"):
        dec.decode_uint8(torch.full((1, 256), 17))
