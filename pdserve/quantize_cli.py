"""The `pdserve quantize` subcommand: its flags, and the run that calls engine.quantize (module docstring there).

    pdserve quantize --method gptq|rtn --bits 4|8 --group-size N [--act-order] [--sym|--no-sym]
                     --calibration FILE --out DIR MODEL

MODEL is a Hugging Face directory, a .gguf file (dequantized to float as the source) or "default". Every flag left
out takes engine.quantize.QuantizeOptions' default; this module does not import torch until the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.cli_args import UsageError

_OPTION_FLAGS = ("method", "bits", "group_size", "act_order", "sym", "num_samples", "seq_len", "damp_percent",
                 "block_size", "checkpoint_format")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `quantize` subcommand to `subparsers` and return its parser."""
    p = subparsers.add_parser("quantize", help="quantize a float checkpoint to a GPTQ checkpoint (GPTQ or RTN)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="Hugging Face directory, .gguf file or 'default' (the source, as float)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the GPTQ checkpoint into")
    p.add_argument("--method", choices=("gptq", "rtn"), default=None, help="GPTQ, or round to nearest (the "
                   "baseline; needs no calibration) (default: gptq)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=None, help="bits per weight (default: 4)")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="inputs per scale/zero group, -1 for one per row (default: 128)")
    p.add_argument("--act-order", action="store_true", default=None,
                   help="GPTQ: quantize inputs by decreasing Hessian diagonal (desc_act, writes g_idx)")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric grids; --no-sym for asymmetric with zero points (default: --sym)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="UTF-8 text the GPTQ Hessians are computed on (required with --method gptq)")
    p.add_argument("--num-samples", type=int, default=None, help="calibration windows at most (default: 128)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per calibration window (default: 512)")
    p.add_argument("--damp-percent", type=float, default=None,
                   help="GPTQ dampening as a fraction of the Hessian's mean diagonal (default: 0.01)")
    p.add_argument("--block-size", type=int, default=None, help="GPTQ lazy-batch columns (default: 128)")
    p.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default=None,
                   help="qzeros convention: gptq (v1, zero - 1; what transformers writes) or gptq_v2 "
                        "(default: gptq)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or per-layer summaries")
    return p


def run(args: argparse.Namespace) -> int:
    from engine.model_fetch import resolve_model_path
    from engine.quantize import QuantizeOptions, quantize_checkpoint

    kwargs = {name: getattr(args, name) for name in _OPTION_FLAGS if getattr(args, name) is not None}
    try:
        options = QuantizeOptions(**kwargs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    text = None
    if options.method == "gptq":
        if args.calibration is None:
            raise UsageError("--calibration FILE is required with --method gptq")
        try:
            text = Path(args.calibration).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--calibration: {exc}") from None
    try:
        source = resolve_model_path(args.model)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        errors = quantize_checkpoint(source, args.out, options, text, progress=not args.quiet, log=log)
    except ValueError as exc:  # ModelLoadError included
        raise UsageError(str(exc)) from None
    mean = sum(errors.values()) / max(len(errors), 1)
    print(f"pdserve: wrote {options.method} {options.bits}-bit checkpoint to {args.out} ({len(errors)} linears, "
          f"mean relative error {mean:.3e})", file=sys.stderr)
    return 0
