"""``tiershard convert``: a ``ts.save`` checkpoint to consolidated safetensors or ``torch.save`` weights.

Runs in one process with no process group, reading one tensor at a time (see ``tiershard.checkpoint.convert``).
"""
from __future__ import annotations

import argparse

from . import CliError

FORMATS = ("safetensors", "torch")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert", help="consolidate a checkpoint into safetensors or torch.save weights",
        description="Write the model of a ts.save checkpoint (a checkpoint folder, or a folder whose `latest` "
                    "names one), or of a plain DCP folder holding {'model': get_model_state_dict(model)} (FSDP2's), "
                    "as full tensors under the module's own names, in one process.")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint folder, a folder with a `latest` pointer, or a plain DCP folder")
    p.add_argument("out", metavar="OUT", help="--to safetensors: a folder; --to torch: a file")
    p.add_argument("--to", dest="to", required=True, metavar="FORMAT",
                   help="safetensors (shards as transformers writes them) or torch (one torch.save file)")
    p.add_argument("--dtype", metavar="DTYPE", default=None,
                   help="cast floating tensors to fp32, bf16 or fp16 (default: as saved, fp32 masters)")
    p.add_argument("--max-shard-size", metavar="SIZE", default="5GB",
                   help="largest safetensors shard, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--config", metavar="HF_CONFIG", default=None,
                   help="a transformers config.json (or its folder) to write beside the safetensors weights")
    p.add_argument("--force", action="store_true", help="replace the model files of an existing OUT")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import convert
    from ..checkpoint import CheckpointError

    if args.to not in FORMATS:
        raise CliError(f"unknown format --to {args.to!r}: choose {' or '.join(FORMATS)}")
    if args.dtype is not None and args.dtype not in convert.DTYPES:
        raise CliError(f"unknown --dtype {args.dtype!r}: choose one of {', '.join(convert.DTYPES)}")
    dtype = convert.DTYPES[args.dtype] if args.dtype else None
    if args.to == "torch" and args.config is not None:
        raise CliError("--config writes a transformers config.json beside safetensors weights: use it with "
                       "--to safetensors")
    try:
        if args.to == "safetensors":
            files = convert.to_safetensors(args.checkpoint, args.out, dtype=dtype,
                                           max_shard_size=args.max_shard_size, config=args.config,
                                           force=args.force)
        else:
            files = [convert.to_torch(args.checkpoint, args.out, dtype=dtype, force=args.force)]
    except (convert.ConvertError, CheckpointError) as err:
        raise CliError(str(err)) from None
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} file(s), {total / 1e6:.1f} MB, to {args.out}")
    return 0
