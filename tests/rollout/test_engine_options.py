"""make_engine and generate reject bad options and arguments with a ValueError naming them."""
import pytest
import torch

from rollout import ENGINES, RolloutModel, make_engine


def test_registry_and_protocol(tiny):
    assert set(ENGINES) == {"cached_ar", "sjd_sync", "sjd_independent", "hbsjd"}
    assert isinstance(tiny(0), RolloutModel)
    e = make_engine("hbsjd", window=8, history_offset=2, decoding="sample", execution="compact")
    assert e.options["window"] == 8 and e.options["execution"] == "compact" and "hbsjd" in repr(e)
    assert make_engine("sjd_sync").options == dict(window=16, history_offset=None,
                                                   decoding="greedy", refresh="coupled",
                                                   compile=False)


@pytest.mark.parametrize("name,options,word", [
    ("hbsjd", dict(window=0), "option window"),
    ("hbsjd", dict(window=2.5), "option window"),
    ("sjd_sync", dict(window=True), "option window"),
    ("sjd_independent", dict(history_offset=0), "option history_offset"),
    ("hbsjd", dict(decoding="beam"), "option decoding"),
    ("cached_ar", dict(decoding="topk"), "option decoding"),
    ("hbsjd", dict(execution="half"), "option execution"),
    ("sjd_independent", dict(refresh="mc"), "option refresh must be one of"),
    ("cached_ar", dict(refresh="coupled"), "no option 'refresh'"),
    ("hbsjd", dict(compile="fast"), "option compile must be one of"),
    ("hbsjd", dict(gamma=-1), "option gamma"),
    ("hbsjd", dict(gamma="fast"), "option gamma"),
    ("cached_ar", dict(window=4), "no option 'window'"),
    ("sjd_independent", dict(execution="compact"), "no option 'execution'"),
    ("hbsjd", dict(W=4), "no option 'W'"),
    ("hbsdj", {}, "unknown engine 'hbsdj' \\(did you mean 'hbsjd'"),
])
def test_bad_options(name, options, word):
    with pytest.raises(ValueError, match=word):
        make_engine(name, **options)


def call(model, engine="hbsjd", B=2, P=3, N=None, opts=None, **kw):
    labels = kw.pop("labels", torch.zeros(B, dtype=torch.long))
    prefix = kw.pop("prefix", torch.zeros(B, P, dtype=torch.long))
    N = model.block_size - P if N is None else N
    return make_engine(engine, **(opts or {})).generate(model, labels, prefix, N, **kw)


@pytest.mark.parametrize("kw,word", [
    (dict(N=0), "num_new_tokens"),
    (dict(P=3, N=14), "num_new_tokens=14 overflows"),
    (dict(P=16, N=1), "prefix of 16 tokens is longer"),
    (dict(top_k=12), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(opts=dict(decoding="sample"), temperature=0.0), "temperature"),
    (dict(labels=torch.tensor([0, 4])), "labels"),
    (dict(labels=torch.zeros(2, 1, dtype=torch.long)), "labels"),
    (dict(prefix=torch.full((2, 3), 11)), "prefix tokens"),
    (dict(prefix=torch.zeros(3, 3, dtype=torch.long)), "prefix must be"),
    (dict(seed=1.5), "seed"),
    (dict(image_ids=torch.arange(3)), "image_ids"),
    (dict(opts=dict(history_offset=16)), "option history_offset=16 is outside the sequence"),
    (dict(engine="sjd_sync", opts=dict(history_offset=99)), "option history_offset=99"),
])
def test_bad_generate_arguments(tiny, kw, word):
    with pytest.raises(ValueError, match=word):
        call(tiny(0), **kw)


def test_boundary_arguments_are_accepted(tiny):
    model = tiny(0)
    assert call(model, P=15, N=1).tokens.shape == (2, 16)          # all but one token
    assert call(model, P=0, N=16, top_k=11, top_p=1.0).tokens.shape == (2, 16)
    assert call(model, opts=dict(history_offset=15, window=100)).tokens.shape == (2, 16)
    assert call(model, prefix=None, N=5).tokens.shape == (2, 5)


def test_an_engine_is_found_from_rollout_engine_alone():
    """A fresh process: `import rollout.options` loads no torch, and make_engine imported from
    rollout.engine finds an engine whose module nothing imported yet (rollout/options.py
    ENGINE_MODULES)."""
    import subprocess
    import sys
    code = ("import sys; import rollout.options; assert 'torch' not in sys.modules; "
            "from rollout.engine import make_engine; e = make_engine('sjd_sync', window=4); "
            "print(type(e).__name__, e.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["SyncSJD", "sjd_sync"]
