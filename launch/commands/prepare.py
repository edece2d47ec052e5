"""`opd prepare`: write a dataset in the layout the runs read.

    opd prepare digits [--grid 8|16] [--out DIR]
    opd prepare llamagen-codes --codes DIR --labels DIR --out FILE
"""
from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("prepare", help="write a dataset (digits, LlamaGen VQ codes)",
                              description="Write a dataset in the layout the runs read.")
    which = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    d = which.add_parser("digits", help="the embedded UCI digits set (scikit-learn, offline)",
                         description="Write the UCI digits set as class-labelled token grids.")
    d.add_argument("--out", metavar="DIR",
                   help="output directory (default: data/digits8 or data/digits16, as data.data_dir)")
    d.add_argument("--grid", type=int, choices=(8, 16), default=8,
                   help="token grid: 8 = the native 8x8 pixels (digits8-v1, the default), 16 = "
                        "bilinear 16x16 (digits16-v1, 256 tokens like LlamaGen at 256 px)")
    c = which.add_parser("llamagen-codes", help="LlamaGen pre-extracted VQ codes -> Parquet",
                         description="Pack LlamaGen's extracted VQ codes (.npy per image) and "
                                     "labels into one Parquet file.")
    c.add_argument("--codes", required=True, metavar="DIR", help="directory of code .npy files")
    c.add_argument("--labels", required=True, metavar="DIR", help="directory of label .npy files")
    c.add_argument("--out", required=True, metavar="FILE", help="output Parquet file")
    c.add_argument("--vocab-size", type=int, default=16384, help="VQ codebook size (default 16384)")
    c.add_argument("--num-classes", type=int, default=1000, help="class labels (default 1000)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.dataset == "digits":
        from opd.data import prepare_digits
        result = prepare_digits(args.out or f"data/digits{args.grid}", args.grid)
    else:
        from opd.data import prepare_llamagen_codes
        result = prepare_llamagen_codes(args.codes, args.labels, args.out,
                                        vocab_size=args.vocab_size, num_classes=args.num_classes)
    written = result.values() if isinstance(result, dict) else [result or args.out]
    print(f"opd prepare {args.dataset}: wrote " + ", ".join(str(w) for w in written))
    return 0
