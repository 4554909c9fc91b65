"""Command line of the converter: ``python -m megatron_mtraining.convert --help``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .pipeline import hf_to_megatron, megatron_to_hf
from .shape import ConversionError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.convert",
        description="Convert Qwen2 / Qwen2.5 / Llama 3.x models between Hugging Face folders and Megatron "
                    "torch_dist checkpoints (what pretrain_gpt.py --pretrained-checkpoint reads).")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-megatron", help="a Hugging Face folder into a Megatron release checkpoint")
    imp.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face model folder (config.json, weights)")
    imp.add_argument("--out", required=True, metavar="CKPT", help="new checkpoint folder (must not exist or be empty)")
    imp.add_argument("--tp", type=int, default=1, metavar="N",
                     help="tensor-parallel size of the run: checked against the head counts and used in the "
                          "vocabulary padding; the checkpoint itself loads at any TP (default 1)")
    imp.add_argument("--tokenizer", metavar="DIR",
                     help="tokenizer folder (default: --hf when it holds one); the run's --tokenizer-model")
    imp.add_argument("--padded-vocab-size", type=int, metavar="N",
                     help="vocabulary rows of the Megatron model (default: the tokenizer's length padded as "
                          "Megatron pads it, to a multiple of --make-vocab-size-divisible-by x TP)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                     help="Megatron's flag of the same name, as the run will pass it (default 128)")
    imp.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                     help="tensor dtype in the checkpoint (default: the model's torch_dtype)")
    exp = sub.add_parser("megatron-to-hf", help="a Megatron checkpoint into a Hugging Face folder")
    exp.add_argument("--ckpt", required=True, metavar="CKPT",
                     help="checkpoint folder (with latest_checkpointed_iteration.txt) or one iteration's folder")
    exp.add_argument("--out", required=True, metavar="DIR", help="new Hugging Face folder")
    exp.add_argument("--hf-base", metavar="DIR",
                     help="the Hugging Face model the run started from (config fields, tokenizer); needed when "
                          "the checkpoint folder has no mtraining_conversion.json")
    exp.add_argument("--max-position-embeddings", type=int, metavar="N",
                     help="context length written to config.json (default: the run's --seq-length)")
    exp.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="exported dtype")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "hf-to-megatron":
            hf_to_megatron(args.hf, args.out, tp=args.tp, tokenizer=args.tokenizer, padded_vocab=args.padded_vocab_size,
                           divisible_by=args.make_vocab_size_divisible_by, dtype=args.dtype)
        else:
            megatron_to_hf(args.ckpt, args.out, hf_base=args.hf_base, dtype=args.dtype,
                           max_position_embeddings=args.max_position_embeddings)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
