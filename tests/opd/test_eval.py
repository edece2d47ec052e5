"""Evaluation: digits CNN extractor registered with torch-fidelity, metric sanity, offline Inception, grids."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
from torch_fidelity.utils import create_feature_extractor

from opd.data import digits_images_to_tokens, digits_split
from opd.eval import features as feat
from opd.eval.fidelity import compute_metrics, load_reference_statistics, save_reference_statistics
from opd.eval.grid import make_grid, save_grid


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh OPD_CACHE with the digits CNN trained into it once for this module."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("opd_cache")
    mp.setenv("OPD_CACHE", str(root))
    feat.digits_cnn_path()
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def digits() -> torch.Tensor:
    return feat.digits_dataset()[0]


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    import torch_fidelity.feature_extractor_inceptionv3 as inception
    monkeypatch.setattr(inception, "load_state_dict_from_url", refuse)


def test_digits_dataset_matches_tokenization(digits):
    from sklearn.datasets import load_digits
    images, labels = feat.digits_dataset()
    raw = load_digits()
    assert images.shape == (1797, 3, 16, 16) and images.dtype == torch.uint8
    assert labels.tolist() == raw.target.tolist()
    tokens = digits_images_to_tokens(raw.images[:3], 16)  # (3, 256) grey levels
    want = np.floor(tokens * 255 / 16 + 0.5).reshape(3, 1, 16, 16)
    assert np.array_equal(images[:3].numpy(), np.broadcast_to(want, (3, 3, 16, 16)))


def test_digits_cnn_cached_accurate_and_registered(cache, digits):
    path = feat.digits_cnn_path()
    assert path.parent == cache and path.is_file()
    model, accuracy = feat.load_digits_cnn(path)
    assert accuracy >= 0.95
    _, labels = feat.digits_dataset()
    _, hold = digits_split(labels.numpy())
    assert len(hold) == 200
    assert feat.classifier_accuracy(model, digits[hold], labels[hold]) == pytest.approx(accuracy, abs=1e-6)

    assert FEATURE_EXTRACTORS_REGISTRY["digits-cnn"] is feat.DigitsFeatureExtractor
    fe = create_feature_extractor("digits-cnn", ["logits", "penultimate"], cuda=False, verbose=False)
    logits, penultimate = fe(digits[:5])
    assert logits.shape == (5, 10) and penultimate.shape == (5, 64)
    assert logits.dtype == penultimate.dtype == torch.float32
    # Larger images are area-resized to 16x16: a 2x nearest upscale gives the same features.
    logits_big, = create_feature_extractor("digits-cnn", ["logits"], cuda=False, verbose=False)(
        digits[:5].repeat_interleave(2, dim=2).repeat_interleave(2, dim=3))
    torch.testing.assert_close(logits_big, logits)
    with pytest.raises(ValueError, match="uint8"):
        fe(digits[:2].float())


def test_digits_cnn_training_is_deterministic():
    threads = torch.get_num_threads()
    cfg = feat.DigitsTraining(epochs=1)
    torch.manual_seed(123)
    a, acc_a = feat.train_digits_cnn(cfg)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)  # the caller's RNG stream is untouched
    b, acc_b = feat.train_digits_cnn(cfg)
    assert acc_a == acc_b
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert torch.get_num_threads() == threads
    assert cfg.cache_name() != feat.DigitsTraining().cache_name()


def test_metric_sanity(cache, digits):
    a, b = digits[:64], digits[64:128]
    same = compute_metrics(a, a, kid=False)
    assert set(same) == {"isc", "isc_std", "fid", "precision", "recall", "f_score"}
    assert abs(same["fid"]) < 1e-6  # identical sets; FID of two different digit samples is ~1e2
    assert same["precision"] == same["recall"] == 1.0
    assert 2.0 < same["isc"] <= 10.0  # 10 classes, confident and diverse

    other = compute_metrics(a, b)
    rolled = compute_metrics(torch.roll(a, shifts=3, dims=-1), b)
    assert other["fid"] > 1.0
    assert rolled["fid"] > 3 * other["fid"]
    assert rolled["precision"] < other["precision"] and rolled["recall"] < other["recall"]
    assert rolled["isc"] < other["isc"]
    for m in (other, rolled):
        assert 1.0 <= m["isc"] <= 10.0
        assert all(0.0 <= m[k] <= 1.0 for k in ("precision", "recall", "f_score"))

    grey = compute_metrics(a[:, 0], b[:, 0], isc=False, prc=False)  # (N, H, W) input
    assert set(grey) == {"fid"} and grey["fid"] == pytest.approx(other["fid"], rel=1e-9)


def test_saved_reference_gives_same_metrics(cache, digits, tmp_path):
    a, b = digits[:64], digits[100:180]
    path = save_reference_statistics(b, tmp_path / "ref" / "digits.pt")
    feats = load_reference_statistics(path, "digits-cnn")
    assert list(feats) == ["penultimate"] and feats["penultimate"].shape == (80, 64)
    direct = compute_metrics(a, b, kid=True, seed=3)
    saved = compute_metrics(a, path, kid=True, seed=3)
    assert set(saved) == set(direct) == {"isc", "isc_std", "fid", "precision", "recall", "f_score", "kid",
                                         "kid_std"}
    for k in direct:
        assert saved[k] == pytest.approx(direct[k], rel=1e-6, abs=1e-9), k
    with pytest.raises(ValueError, match="made with 'digits-cnn'"):
        load_reference_statistics(path, "inception-v3-compat")


def test_bad_arguments_are_named(cache, digits):
    with pytest.raises(ValueError, match="unknown feature extractor 'vgg'"):
        compute_metrics(digits[:8], digits[:8], extractor="vgg")
    with pytest.raises(ValueError, match="uint8"):
        compute_metrics(digits[:8].float(), digits[:8])
    with pytest.raises(ValueError, match="no metric"):
        compute_metrics(digits[:8], digits[:8], isc=False, fid=False, prc=False)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        compute_metrics(digits[:8], "nope.pt")


def test_inception_needs_local_weights(digits, tmp_path):
    for path in (None, tmp_path / "weights-inception.pth"):
        with pytest.raises(FileNotFoundError, match=r"eval\.inception_weights.*weights-inception-2015-12-05"):
            compute_metrics(digits[:8], digits[8:16], extractor="inception-v3-compat", weights_path=path)


@pytest.fixture
def inception_weights(tmp_path, monkeypatch):
    """A file of random Inception-v3 weights in torch-fidelity's format (the real ones need a download)."""
    import torch_fidelity.feature_extractor_inceptionv3 as inception
    empty = tmp_path / "empty.pt"
    torch.save({}, empty)
    with monkeypatch.context() as m:
        m.setattr(inception.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd, strict=True: None)
        torch.manual_seed(0)
        net = inception.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                    feature_extractor_weights_path=str(empty))
    path = tmp_path / "inception.pth"
    torch.save(net.state_dict(), path)
    return path


def test_inception_weights_file_is_loaded(digits, inception_weights, monkeypatch):
    """The configured file reaches torch-fidelity's Inception (strict load; downloads refused)."""
    import torch_fidelity.feature_extractor_inceptionv3 as inception
    loaded = []
    real_load = inception.FeatureExtractorInceptionV3.load_state_dict

    def load(self, sd, strict=True):
        loaded.append(len(sd))
        return real_load(self, sd, strict)

    def cheap_forward(self, x):  # the real 299x299 forward takes ~1 s per image on this CPU
        pooled = x.float().mean(dim=(2, 3))
        out = {"2048": pooled.repeat(1, 683)[:, :2048], "logits_unbiased": pooled.repeat(1, 336)}
        return tuple(out[k] for k in self.features_list)

    monkeypatch.setattr(inception.FeatureExtractorInceptionV3, "load_state_dict", load)
    monkeypatch.setattr(inception.FeatureExtractorInceptionV3, "forward", cheap_forward)
    out = compute_metrics(digits[:6], digits[6:12], extractor="inception-v3-compat",
                          weights_path=inception_weights, isc_splits=1, fid=False)  # 2048² eigvals: ~20 s
    assert loaded == [len(torch.load(inception_weights, weights_only=True))]
    assert set(out) == {"isc", "isc_std", "precision", "recall", "f_score"}


@pytest.mark.slow
def test_inception_runs_offline_from_a_weights_file(digits, inception_weights):
    out = compute_metrics(digits[:5], digits[5:10], extractor="inception-v3-compat",
                          weights_path=inception_weights, isc_splits=1)
    assert set(out) == {"isc", "isc_std", "fid", "precision", "recall", "f_score"}
    assert all(math.isfinite(v) for v in out.values())


def test_grid(tmp_path):
    images = torch.arange(5 * 2 * 3, dtype=torch.uint8).reshape(5, 2, 3) * 8  # grey (N, H, W)
    grid = make_grid(images, nrow=3, upscale=2, padding=1, pad_value=0)
    assert grid.shape == (3, 2 * (4 + 1) + 1, 3 * (6 + 1) + 1)
    # image 4 sits in row 1, column 1; its pixel (1, 2) is upscaled to a 2x2 block.
    y, x = 1 + 1 * 5, 1 + 1 * 7
    assert grid[:, y + 2:y + 4, x + 4:x + 6].unique().tolist() == [int(images[4, 1, 2])]
    assert grid[:, :, 0].eq(0).all() and grid[:, y:y + 4, 1 + 2 * 7:].eq(0).all()  # padding, empty cell

    path = save_grid(images, tmp_path / "sub" / "grid.png", nrow=3, upscale=2, padding=1)
    png = np.asarray(Image.open(path))
    assert png.shape == (11, 22, 3) and png.dtype == np.uint8
    assert np.array_equal(png, grid.permute(1, 2, 0).numpy())
    rgb = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    assert np.array_equal(np.asarray(Image.open(save_grid(rgb, tmp_path / "rgb.png", nrow=4, padding=0))),
                          torch.cat(list(rgb), dim=2).permute(1, 2, 0).numpy())
