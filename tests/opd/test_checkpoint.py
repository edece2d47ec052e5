"""Safe, strict loading of LlamaGen-style checkpoints."""
import argparse
import os

import pytest
import torch

from opd.models import CheckpointError, create_model, load_llamagen_checkpoint, load_state_dict_safely
from opd.models.args import PRESETS

# GPT-B's official key names and shapes (docs/FACTS.md §1), one block shown; 12 blocks in the file.
GPT_B_KEYS = {
    "tok_embeddings.weight": (16384, 768),
    "cls_embedding.embedding_table.weight": (1001, 768),
    "layers.{i}.attention.wqkv.weight": (2304, 768),
    "layers.{i}.attention.wo.weight": (768, 768),
    "layers.{i}.feed_forward.w1.weight": (2048, 768),
    "layers.{i}.feed_forward.w3.weight": (2048, 768),
    "layers.{i}.feed_forward.w2.weight": (768, 2048),
    "layers.{i}.attention_norm.weight": (768,),
    "layers.{i}.ffn_norm.weight": (768,),
    "norm.weight": (768,),
    "output.weight": (16384, 768),
}


def official_gpt_b_state(n_layer=12):
    """A state dict spelled from the official key list, not from our module."""
    state = {}
    for key, shape in GPT_B_KEYS.items():
        for i in range(n_layer) if "{i}" in key else [None]:
            state[key.format(i=i)] = torch.full(shape, 0.01 * (i or 0) + 0.001)
    return state


def test_official_gpt_b_layout_loads_strictly(tmp_path):
    state = official_gpt_b_state()
    state["freqs_cis"] = torch.zeros(257, 32, 2)              # older files carry the table
    path = tmp_path / "c2i_B_256.pt"
    args = argparse.Namespace(gpt_model="GPT-B", image_size=256, lr=1e-4)
    torch.save({"model": state, "optimizer": {"state": {}}, "steps": 10, "args": args}, path)
    model = load_llamagen_checkpoint(path, "GPT-B")
    assert set(model.state_dict()) == set(state) - {"freqs_cis"}
    assert torch.equal(model.layers[11].feed_forward.w2.weight, state["layers.11.feed_forward.w2.weight"])


@pytest.mark.parametrize("wrap", ["module", "state_dict", "raw", "ddp-prefix"])
def test_weight_locations(tmp_path, wrap):
    model = create_model("GPT-tiny")
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    obj = {"raw": state, "ddp-prefix": {"module." + k: v for k, v in state.items()}}.get(wrap)
    obj = obj if obj is not None else {wrap: state}
    torch.save(obj, tmp_path / "ck.pt")
    loaded = load_llamagen_checkpoint(tmp_path / "ck.pt", "GPT-tiny")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())


def test_mis_shaped_missing_and_unexpected_keys_are_listed(tmp_path):
    state = create_model("GPT-tiny").state_dict()
    state["output.weight"] = torch.zeros(7, 32)
    del state["norm.weight"]
    state["extra.bias"] = torch.zeros(3)
    torch.save({"model": state}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        load_llamagen_checkpoint(tmp_path / "bad.pt", "GPT-tiny")
    msg = str(e.value)
    assert "missing keys [norm.weight]" in msg and "unexpected keys [extra.bias]" in msg
    assert "output.weight: file (7, 32) vs model (11, 32)" in msg and "\n" not in msg


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/opd_exploit_marker",))


def test_pickle_that_runs_code_is_refused(tmp_path):
    marker = "/tmp/opd_exploit_marker"
    if os.path.exists(marker):
        os.remove(marker)
    state = create_model("GPT-tiny").state_dict()
    torch.save({"model": state, "args": Exploit()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refused to load"):
        load_llamagen_checkpoint(tmp_path / "evil.pt", "GPT-tiny")
    assert not os.path.exists(marker)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nope.pt does not exist"):
        load_llamagen_checkpoint(tmp_path / "nope.pt", "GPT-tiny")


def test_all_presets_are_constructible_as_args():
    assert {"GPT-B", "GPT-L", "GPT-XL", "GPT-XXL", "GPT-XXXL", "GPT-3B"} <= set(PRESETS)


def test_a_file_that_is_not_a_checkpoint_is_named_as_such(tmp_path):
    for name, data in (("notes.txt", b"hello, not weights\n"), ("empty.pt", b""),
                       ("data.parquet", b"PAR1\x00\x01")):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=r"is not a checkpoint \(neither a file written by torch.save nor safetensors\)"):
            load_state_dict_safely(path)
