"""Generation quality (IS, FID, precision/recall, KID) with torch-fidelity, offline, from tensors.

`compute_metrics(generated, reference)` returns short metric names:

    isc, isc_std        Inception Score (mean, std over `isc_splits`) of `generated`
    fid                 Fréchet distance between generated and reference features
    precision, recall, f_score   k-NN manifold precision / recall (Kynkäänniemi et al.)
    kid, kid_std        Kernel Inception Distance (off by default)

The reference is a uint8 tensor of images, or the path of a file written by
`save_reference_statistics` (its features, so a large reference set is processed once).  With
a tensor reference the metrics come from `torch_fidelity.calculate_metrics` on in-memory
datasets; with a saved reference they come from torch-fidelity's own metric functions applied to
the generated features and the saved reference features, which gives the same numbers.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch_fidelity
from torch import Tensor
from torch.utils.data import Dataset
from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
from torch_fidelity.metric_isc import isc_featuresdict_to_metric
from torch_fidelity.metric_kid import kid_featuresdict_to_metric
from torch_fidelity.metric_prc import prc_featuresdict_to_metric
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
from torch_fidelity.utils import create_feature_extractor, get_featuresdict_from_dataset

from opd.eval.features import DIGITS_EXTRACTOR, INCEPTION_EXTRACTOR, inception_weights_path

EXTRACTORS = (DIGITS_EXTRACTOR, INCEPTION_EXTRACTOR)
REFERENCE_FORMAT = "opd-fidelity-reference-v1"

_SHORT_NAMES = {
    "inception_score_mean": "isc", "inception_score_std": "isc_std",
    "frechet_inception_distance": "fid",
    "precision": "precision", "recall": "recall", "f_score": "f_score",
    "kernel_inception_distance_mean": "kid", "kernel_inception_distance_std": "kid_std",
}


class ImageTensorDataset(Dataset):
    """uint8 images (N, 3, H, W) or grey (N, H, W) → items (3, H, W) uint8, as torch-fidelity expects."""

    def __init__(self, images: Tensor):
        if images.dtype != torch.uint8:
            raise ValueError(f"images must be uint8 pixels, got {images.dtype} (use opd.models.vq.to_uint8)")
        if images.dim() == 3:
            images = images.unsqueeze(1)
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"images must be (N, 3, H, W) or (N, H, W), got {tuple(images.shape)}")
        self.images = images.expand(-1, 3, -1, -1).cpu().contiguous()

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> Tensor:
        return self.images[i]


def _fidelity_kwargs(extractor: str, weights_path: str | os.PathLike | None, batch_size: int, seed: int,
                     isc_splits: int, prc_neighborhood: int, verbose: bool) -> dict:
    """torch-fidelity keyword arguments shared by both paths: offline, no file cache, no workers."""
    if extractor not in EXTRACTORS:
        raise ValueError(f"unknown feature extractor {extractor!r}; known: {', '.join(EXTRACTORS)}")
    if extractor == INCEPTION_EXTRACTOR:
        weights_path = inception_weights_path(weights_path)  # never let torch-fidelity download
    elif weights_path is not None and not os.path.isfile(weights_path):
        raise FileNotFoundError(f"digits CNN weights {str(weights_path)!r} not found")
    return dict(
        feature_extractor=extractor,
        feature_extractor_weights_path=None if weights_path is None else str(weights_path),
        cuda=torch.cuda.is_available(),
        batch_size=batch_size,
        rng_seed=seed,
        isc_splits=isc_splits,
        prc_neighborhood=prc_neighborhood,
        cache=False,
        save_cpu_ram=True,  # no DataLoader worker processes
        datasets_download=False,
        verbose=verbose,
    )


def _layers(extractor: str) -> dict[str, str]:
    """Feature layer per metric (isc, fid, kid, prc), the extractor's defaults."""
    cls = FEATURE_EXTRACTORS_REGISTRY[extractor]
    return {m: cls.get_default_feature_layer_for_metric(m) for m in ("isc", "fid", "kid", "prc")}


def _short(metrics: dict) -> dict[str, float]:
    return {_SHORT_NAMES[k]: float(v) for k, v in metrics.items() if k in _SHORT_NAMES}


def extract_features(images: Tensor, *, extractor: str = DIGITS_EXTRACTOR,
                     weights_path: str | os.PathLike | None = None, layers: list[str] | None = None,
                     batch_size: int = 64, verbose: bool = False) -> dict[str, Tensor]:
    """uint8 images (N, 3, H, W) → {layer: (N, F) float32} (default: the fid/kid/prc and isc layers)."""
    kw = _fidelity_kwargs(extractor, weights_path, batch_size, 0, 10, 3, verbose)
    layers = layers or sorted(set(_layers(extractor).values()))
    fe = create_feature_extractor(extractor, layers, **kw)
    return get_featuresdict_from_dataset(ImageTensorDataset(images), fe, batch_size, kw["cuda"], True, verbose)


def save_reference_statistics(reference: Tensor, path: str | os.PathLike, *, extractor: str = DIGITS_EXTRACTOR,
                              weights_path: str | os.PathLike | None = None, batch_size: int = 64) -> Path:
    """Extract the reference set's fid/kid/prc features once and save them (with metadata) to `path`.

    reference: uint8 (N, 3, H, W).  The file holds (N, F) float32 features per layer: about
    400 MB for 50k Inception features.
    """
    layers = sorted({v for m, v in _layers(extractor).items() if m != "isc"})
    feats = extract_features(reference, extractor=extractor, weights_path=weights_path, layers=layers,
                             batch_size=batch_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": REFERENCE_FORMAT, "extractor": extractor, "num_images": int(reference.shape[0]),
                "image_shape": list(reference.shape[1:]),
                "weights_file": None if weights_path is None else os.path.basename(str(weights_path)),
                "features": feats}, path)
    return path


def load_reference_statistics(path: str | os.PathLike, extractor: str) -> dict[str, Tensor]:
    """{layer: (N, F) float32} from a `save_reference_statistics` file made with `extractor`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reference statistics {str(path)!r} not found; write them with "
                                f"opd.eval.fidelity.save_reference_statistics")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != REFERENCE_FORMAT:
        raise ValueError(f"{str(path)!r} is not an opd reference-statistics file ({REFERENCE_FORMAT})")
    if blob["extractor"] != extractor:
        raise ValueError(f"reference statistics {str(path)!r} were made with {blob['extractor']!r}, "
                         f"not {extractor!r}")
    return blob["features"]


def compute_metrics(generated: Tensor, reference: Tensor | str | os.PathLike, *,
                    extractor: str = DIGITS_EXTRACTOR, weights_path: str | os.PathLike | None = None,
                    isc: bool = True, fid: bool = True, prc: bool = True, kid: bool = False,
                    batch_size: int = 64, seed: int = 0, isc_splits: int = 10, prc_neighborhood: int = 3,
                    kid_subset_size: int = 1000, verbose: bool = False) -> dict[str, float]:
    """Metrics of uint8 `generated` (N, 3, H, W) against `reference` (uint8 images or a saved file).

    weights_path: the Inception weights file (`eval.inception_weights`, required for
    "inception-v3-compat") or a digits CNN file (None: the cached default).  Runs on CUDA when
    available.  Returns the short names listed in the module docstring.
    """
    if not (isc or fid or prc or kid):
        raise ValueError("compute_metrics: no metric requested (isc, fid, prc, kid are all False)")
    kw = _fidelity_kwargs(extractor, weights_path, batch_size, seed, isc_splits, prc_neighborhood, verbose)
    gen = ImageTensorDataset(generated)
    if isinstance(reference, Tensor):
        ref = ImageTensorDataset(reference)
        if kid:
            kw["kid_subset_size"] = min(kid_subset_size, len(gen), len(ref))
        return _short(torch_fidelity.calculate_metrics(input1=gen, input2=ref, isc=isc, fid=fid, prc=prc,
                                                       kid=kid, **kw))

    ref_feats = load_reference_statistics(reference, extractor)
    layers = _layers(extractor)
    wanted = [m for m, on in (("isc", isc), ("fid", fid), ("kid", kid), ("prc", prc)) if on]
    fe = create_feature_extractor(extractor, sorted({layers[m] for m in wanted}), **kw)
    gen_feats = get_featuresdict_from_dataset(gen, fe, batch_size, kw["cuda"], True, verbose)
    out: dict = {}
    if isc:
        out.update(isc_featuresdict_to_metric(gen_feats, layers["isc"], **kw))
    if fid:
        stats = [fid_features_to_statistics(f[layers["fid"]]) for f in (gen_feats, ref_feats)]
        out.update(fid_statistics_to_metric(*stats, verbose))
    if kid:
        kw["kid_subset_size"] = min(kid_subset_size, len(gen), len(ref_feats[layers["kid"]]))
        out.update(kid_featuresdict_to_metric(gen_feats, ref_feats, layers["kid"], **kw))
    if prc:
        out.update(prc_featuresdict_to_metric(gen_feats, ref_feats, layers["prc"], **kw))
    return _short(out)
