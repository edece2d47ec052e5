"""Offline feature extractors for torch-fidelity: Inception-v3 from a local file, and a digits CNN.

Nothing here downloads.  ImageNet-scale runs use torch-fidelity's `inception-v3-compat` with the
weights file named by the config key `eval.inception_weights`.  The embedded digits default uses
`digits-cnn`: a small CNN trained deterministically on the train split of sklearn's digits
(decoded exactly as digits tokens decode, `opd.data`: 16×16 pixels for both tokenizations), cached under `$OPD_CACHE` (default `~/.cache/opd/`), and registered with
torch-fidelity like its own extractors.  It provides

    'penultimate'  (B, 64) float32   FID / KID / precision-recall features
    'logits'       (B, 10) float32   Inception-Score logits (10 digit classes)
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from rollout.calibrate import cache_root
from opd.data import digits_images_to_tokens, digits_split, digits_tokens_to_images

DIGITS_EXTRACTOR = "digits-cnn"
INCEPTION_EXTRACTOR = "inception-v3-compat"
INCEPTION_CONFIG_KEY = "eval.inception_weights"
DIGITS_SIDE = 16


# ---------------------------------------------------------------------------------------------
# Inception-v3 (torch-fidelity's TF-compatible port) from a local file.

def inception_weights_path(path: str | os.PathLike | None) -> str:
    """The existing Inception weights file, or a FileNotFoundError that says how to get one."""
    if path is not None and os.path.isfile(path):
        return str(path)
    where = "is not set" if path is None else f"points to {str(path)!r}, which does not exist"
    raise FileNotFoundError(
        f"{INCEPTION_CONFIG_KEY} {where}. FID/IS/precision-recall with {INCEPTION_EXTRACTOR!r} need "
        f"torch-fidelity's Inception-v3 weights as a local file (this project never downloads them). "
        f"On a machine with internet access fetch {URL_INCEPTION_V3} , copy it here and set "
        f"{INCEPTION_CONFIG_KEY}=/path/to/{URL_INCEPTION_V3.rsplit('/', 1)[-1]}."
    )


# ---------------------------------------------------------------------------------------------
# Digits CNN.

class DigitsCNN(nn.Module):
    """uint8 images (B, 3, H, W) → grey 16×16 → (penultimate (B, 64), logits (B, 10))."""

    def __init__(self, width: int = 32, features: int = 64, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.conv3 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 16, features)
        self.head = nn.Linear(features, classes)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        x = images.float().mean(dim=1, keepdim=True) / 255.0  # (B, 1, H, W) in [0, 1]
        if x.shape[-2:] != (DIGITS_SIDE, DIGITS_SIDE):
            x = F.interpolate(x, size=(DIGITS_SIDE, DIGITS_SIDE), mode="area")
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, w, 8, 8)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)  # (B, 2w, 4, 4)
        feat = F.relu(self.fc(x.flatten(1)))         # (B, 64)
        return feat, self.head(feat)


@dataclass(frozen=True)
class DigitsTraining:
    """Everything that determines the trained digits CNN (hashed into its cache file name)."""

    seed: int = 0
    epochs: int = 12
    batch_size: int = 64
    lr: float = 2e-3
    version: int = 1  # bump when the data, split or network change

    def cache_name(self) -> str:
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]
        return f"digits_cnn_{digest}.pt"


def digits_dataset() -> tuple[Tensor, Tensor]:
    """sklearn's digits exactly as digits tokens decode (`opd.data`; 16×16 pixels).

    Returns images (1797, 3, 16, 16) uint8 and labels (1797,) int64, in sklearn's order; the
    train / held-out rows are `opd.data.digits_split(labels)`.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    grey = torch.from_numpy(digits_tokens_to_images(digits_images_to_tokens(data.images)))  # (N, 16, 16)
    images = grey.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    return images, torch.as_tensor(data.target, dtype=torch.int64)


@contextmanager
def _deterministic_single_thread():
    """One thread, deterministic kernels and a forked CPU RNG; the caller's settings are restored."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(det)
        torch.set_num_threads(threads)


@torch.no_grad()
def classifier_accuracy(model: DigitsCNN, images: Tensor, labels: Tensor) -> float:
    """Top-1 accuracy of `model` on uint8 images (N, 3, H, W) with labels (N,)."""
    return float((model.eval()(images)[1].argmax(-1) == labels).float().mean())


def train_digits_cnn(cfg: DigitsTraining = DigitsTraining()) -> tuple[DigitsCNN, float]:
    """Train the digits CNN on the train split, on CPU, single-threaded and deterministic.

    Returns (model, accuracy on the 200 held-out images of `opd.data.digits_split`).
    """
    images, labels = digits_dataset()
    train_idx, hold_idx = (torch.from_numpy(i) for i in digits_split(labels.numpy()))
    with _deterministic_single_thread(), torch.enable_grad():  # callers may be under no_grad
        torch.manual_seed(cfg.seed)
        model = DigitsCNN()
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        for _ in range(cfg.epochs):
            model.train()
            order = train_idx[torch.randperm(len(train_idx), generator=gen)]
            for start in range(0, len(order), cfg.batch_size):
                idx = order[start:start + cfg.batch_size]
                loss = F.cross_entropy(model(images[idx])[1], labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        accuracy = classifier_accuracy(model, images[hold_idx], labels[hold_idx])
    return model.eval().requires_grad_(False), accuracy


def digits_cnn_path(cfg: DigitsTraining = DigitsTraining(), directory: str | os.PathLike | None = None) -> Path:
    """Path of the cached digits CNN, training and saving it first if absent (once per cache)."""
    path = Path(directory or cache_root()) / cfg.cache_name()
    if not path.is_file():
        model, accuracy = train_digits_cnn(cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"state_dict": model.state_dict(), "holdout_accuracy": accuracy,
                    "training": asdict(cfg)}, tmp)
        os.replace(tmp, path)  # atomic: concurrent processes never see a half-written file
    return path


def load_digits_cnn(path: str | os.PathLike | None = None) -> tuple[DigitsCNN, float]:
    """(model in eval mode, its recorded held-out accuracy) from `path` or the default cache."""
    path = Path(path) if path is not None else digits_cnn_path()
    if not path.is_file():
        raise FileNotFoundError(f"digits CNN weights {str(path)!r} not found; leave the weights path unset "
                                f"to train and cache them under {cache_root()}")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = DigitsCNN()
    model.load_state_dict(blob["state_dict"])
    return model.eval().requires_grad_(False), float(blob["holdout_accuracy"])


class DigitsFeatureExtractor(FeatureExtractorBase):
    """torch-fidelity extractor `digits-cnn`: uint8 (B, 3, H, W) → requested features, in request order.

    `feature_extractor_weights_path` (a torch-fidelity kwarg) names a saved CNN; None uses the
    cached default, trained on first use.
    """

    def __init__(self, name: str, features_list: list[str], feature_extractor_weights_path: str | None = None,
                 **kwargs):
        super().__init__(name, features_list)
        self.net, self.holdout_accuracy = load_digits_cnn(feature_extractor_weights_path)

    @staticmethod
    def get_provided_features_list() -> tuple[str, ...]:
        return "penultimate", "logits"

    @staticmethod
    def get_default_feature_layer_for_metric(metric: str) -> str:
        return {"isc": "logits", "fid": "penultimate", "kid": "penultimate", "prc": "penultimate"}[metric]

    @staticmethod
    def can_be_compiled() -> bool:
        return False

    @staticmethod
    def get_dummy_input_for_compile() -> Tensor:
        return torch.zeros(1, 3, DIGITS_SIDE, DIGITS_SIDE, dtype=torch.uint8)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected uint8 images (B, 3, H, W), got {tuple(x.shape)} {x.dtype}")
        feat, logits = self.net(x)
        out = {"penultimate": feat, "logits": logits}
        return tuple(out[name].float() for name in self.features_list)


def register_digits_extractor() -> None:
    """Register `digits-cnn` with torch-fidelity (idempotent)."""
    if DIGITS_EXTRACTOR not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(DIGITS_EXTRACTOR, DigitsFeatureExtractor)


register_digits_extractor()
