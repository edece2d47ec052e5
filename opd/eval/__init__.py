"""Sample-quality evaluation, offline.

    features   torch-fidelity feature extractors: Inception-v3 from a local file, `digits-cnn`
    fidelity   compute_metrics (IS, FID, precision / recall, KID), reference statistics files
    grid       sample grids as PNG

Import the submodules directly: `opd.eval.grid` stays free of torch-fidelity.
"""
