"""Command line of the long-context evaluation: ``python -m megatron_mtraining.evaluate --help``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

from .errors import EvaluationError
from .heatmap import format_length, write_heatmap
from .needle import build_sample, parse_depths, parse_length, parse_lengths, run_needle, text_pieces, token_pieces
from .perplexity import bucket_edges, load_documents, run_perplexity


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.evaluate",
        description="Long-context evaluation of a trained model: needle-in-a-haystack retrieval over lengths and "
                    "depths (needle.json, needle.png) and perplexity by position (perplexity.json), with the "
                    "model's dense attention or MTraining's sparse attention.")
    model = p.add_argument_group("model")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="Hugging Face model folder (config.json, weights, tokenizer)")
    source.add_argument("--ckpt", metavar="CKPT",
                        help="Megatron torch_dist checkpoint: exported to a temporary Hugging Face folder first")
    model.add_argument("--hf-base", metavar="DIR",
                       help="with --ckpt: the Hugging Face model the run started from, where the checkpoint has no "
                            "mtraining_conversion.json")
    model.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the model's)")
    model.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="default: float32 on the CPU, bfloat16 on a GPU")
    model.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda where available)")
    model.add_argument("--out", required=True, metavar="DIR", help="folder for needle.json, needle.png, "
                                                                   "perplexity.json (created)")
    attention = p.add_argument_group("attention")
    attention.add_argument("--attention", default="dense", choices=("dense", "mtraining"),
                           help="dense: the model's own (transformers' sdpa); mtraining: MTraining's sparse attention, "
                                "the index from each layer's q and k (default dense)")
    attention.add_argument("--index", default="vs", choices=("vs", "dense"),
                           help="with --attention mtraining: vs (approximated, as in training) or dense (all keys)")
    attention.add_argument("--top-p", type=float, default=0.9, help="attention mass the index covers (default 0.9)")
    attention.add_argument("--block-size", type=int, default=64, choices=(64, 128), help="default 64")
    attention.add_argument("--last-q", type=int, default=64, help="queries the approximator scores (default 64)")
    attention.add_argument("--min-vertical", type=int, default=None,
                           help="floor of vertical columns per head (default: MTraining's, 256)")
    attention.add_argument("--dense-layers", type=int, default=0, metavar="N",
                           help="the first N layers with the dense index, as --mtraining-dense-layers trained them")
    needle = p.add_argument_group("needle in a haystack")
    needle.add_argument("--needle-lengths", default="1k,2k,4k", metavar="LIST",
                        help="sample lengths in tokens, k / M suffixes (default 1k,2k,4k)")
    needle.add_argument("--needle-depths", default="0,0.25,0.5,0.75,1", metavar="LIST",
                        help="needle positions as fractions of the haystack (default 0,0.25,0.5,0.75,1)")
    needle.add_argument("--needle-trials", type=int, default=3, metavar="N",
                        help="samples per cell, each with its own passkey (default 3)")
    needle.add_argument("--needle-mode", default="text", choices=("text", "tokens"),
                        help="text: the passkey prompt in words; tokens: random tokens, a marker and a token "
                             "passkey (any tokenizer) (default text)")
    needle.add_argument("--no-needle", action="store_true", help="skip the needle test")
    needle.add_argument("--seed", type=int, default=0, help="seed of passkeys and random filler (default 0)")
    ppl = p.add_argument_group("perplexity by position")
    ppl.add_argument("--ppl-data", metavar="FILE",
                     help=".txt (tokenized, cut into --ppl-length documents) or .pt / .npy token ids [docs, tokens]")
    ppl.add_argument("--ppl-length", metavar="N", help="tokens per document (k / M suffixes; default: a .txt file "
                                                       "max_position_embeddings, a tensor its width)")
    ppl.add_argument("--ppl-docs", type=int, metavar="N", help="at most N documents (default all)")
    ppl.add_argument("--ppl-buckets", type=int, default=8, metavar="N", help="position buckets (default 8)")
    p.add_argument("--allow-longer", action="store_true",
                   help="evaluate lengths past the model's max_position_embeddings")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except EvaluationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from .attention import enable_mtraining_attention, index_densities, mtraining_attention_config
    from .model import open_model

    lengths = parse_lengths(args.needle_lengths)
    depths = parse_depths(args.needle_depths)
    ppl_length = parse_length(args.ppl_length) if args.ppl_length else None
    if args.needle_trials < 1:
        raise EvaluationError(f"--needle-trials {args.needle_trials}: give at least 1")
    if args.ppl_docs is not None and args.ppl_docs < 1:
        raise EvaluationError(f"--ppl-docs {args.ppl_docs}: give at least 1")
    if args.no_needle and not args.ppl_data:
        raise EvaluationError("nothing to evaluate: --no-needle without --ppl-data")
    if args.dense_layers and args.attention != "mtraining":
        raise EvaluationError("--dense-layers goes with --attention mtraining")
    config = None
    if args.attention == "mtraining":
        fields = dict(last_q=args.last_q)
        if args.min_vertical is not None:
            fields["min_vertical"] = args.min_vertical
        try:
            config = mtraining_attention_config(top_p=args.top_p, block_size=args.block_size, index=args.index,
                                                **fields)
        except ValueError as err:
            raise EvaluationError(str(err)) from None
    if args.hf_base and not args.ckpt:
        raise EvaluationError("--hf-base goes with --ckpt (the Hugging Face model a Megatron run started from)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise EvaluationError(f"--out {args.out} is a file: give a folder")
    log = lambda message: print(message, flush=True)  # noqa: E731

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # this command prints its own progress
    with open_model(args.hf, args.ckpt, hf_base=args.hf_base, tokenizer=args.tokenizer, dtype=args.dtype,
                    device=args.device, log=log) as loaded:
        limit = loaded.max_positions
        asked = ([] if args.no_needle else [("needle length", n) for n in lengths]) + \
                ([("--ppl-length", ppl_length)] if ppl_length else [])
        for what, n in asked:
            if limit and n > limit and not args.allow_longer:
                raise EvaluationError(f"{what} {n} exceeds the model's max_position_embeddings {limit} (config.json): "
                                      "lower it, or pass --allow-longer to evaluate past the trained context")
        needs_tokenizer = (not args.no_needle and args.needle_mode == "text") or \
                          (args.ppl_data or "").lower().endswith(".txt")
        if needs_tokenizer and loaded.tokenizer is None:
            raise EvaluationError(f"no tokenizer in {args.tokenizer or loaded.folder} (tokenizer.json, tokenizer.model "
                                  "or vocab.json): give --tokenizer DIR, or use --needle-mode tokens and token ids "
                                  "(.pt / .npy) for --ppl-data")
        docs = None
        if args.ppl_data:
            length = ppl_length or (limit if args.ppl_data.lower().endswith(".txt") else None)
            docs = load_documents(args.ppl_data, loaded.tokenizer, length, args.ppl_docs)
            if limit and docs.shape[1] > limit and not args.allow_longer:
                raise EvaluationError(f"--ppl-data documents of {docs.shape[1]} tokens exceed the model's "
                                      f"max_position_embeddings {limit}: give --ppl-length, or --allow-longer")
        model = loaded.model
        densities = None
        if config is not None:
            enable_mtraining_attention(model, config, dense_layers=args.dense_layers)
            densities = lambda: index_densities(model)  # noqa: E731
        settings = dict(model=loaded.source, dtype=str(loaded.dtype).replace("torch.", ""), device=str(loaded.device),
                        max_position_embeddings=limit, attention=args.attention,
                        mtraining=None if config is None else _config_json(config, args.dense_layers))
        os.makedirs(args.out, exist_ok=True)
        needle = perplexity = None
        pieces = None
        if not args.no_needle:
            if args.needle_mode == "text":
                pieces = lambda trial: text_pieces(loaded.tokenizer, trial, args.seed)  # noqa: E731
            else:
                special = set(getattr(loaded.tokenizer, "all_special_ids", None) or [])
                vocabulary = [i for i in range(loaded.vocab_size) if i not in special]
                pieces = lambda trial: token_pieces(vocabulary, trial, args.seed)  # noqa: E731
            build_sample(min(lengths), 0.0, pieces(0))  # bad input fails here, before any cell runs
        if docs is not None:
            bucket_edges(docs.shape[1], args.ppl_buckets)
        written = []
        if pieces is not None:
            needle = run_needle(model, pieces, lengths, depths, args.needle_trials, loaded.device, densities, log)
            needle["settings"] = dict(settings, lengths=lengths, depths=depths, trials=args.needle_trials,
                                      mode=args.needle_mode, seed=args.seed)
            _write_json(os.path.join(args.out, "needle.json"), needle)
            written += ["needle.json", "needle.png"]
            grid = [[_cell(needle, n, d)["accuracy"] for n in lengths] for d in depths]
            title = f"Needle in a haystack ({args.attention} attention)"
            write_heatmap(os.path.join(args.out, "needle.png"), grid, lengths, depths, title=title)
        if docs is not None:
            if densities is not None:
                densities()  # the needle's record is not the perplexity's
            perplexity = run_perplexity(model, docs, args.ppl_buckets, loaded.device, log)
            if densities is not None:
                values = densities()
                perplexity["index_density"] = sum(values) / len(values) if values else None
            perplexity["settings"] = dict(settings, data=os.path.abspath(args.ppl_data))
            _write_json(os.path.join(args.out, "perplexity.json"), perplexity)
            written.append("perplexity.json")
    print(summary(needle, perplexity, lengths, depths))
    print(f"[evaluate] wrote {', '.join(written)} in {args.out}")
    return 0


def summary(needle: Optional[Dict], perplexity: Optional[Dict], lengths: List[int], depths: List[float]) -> str:
    """The closing tables: needle accuracy (depth x length) and perplexity per position bucket."""
    lines = []
    if needle is not None:
        lines.append("needle accuracy (rows: depth, columns: length)")
        lines.append("depth  " + "".join(f"{format_length(n):>8}" for n in lengths))
        for d in depths:
            lines.append(f"{d:5.2f}  " + "".join(f"{_cell(needle, n, d)['accuracy']:8.2f}" for n in lengths))
        means = [sum(_cell(needle, n, d)["accuracy"] for d in depths) / len(depths) for n in lengths]
        lines.append("mean   " + "".join(f"{m:8.2f}" for m in means) + f"   overall {needle['accuracy']:.2f}")
    if perplexity is not None:
        lines.append(f"perplexity by position ({perplexity['documents']} documents of {perplexity['length']} tokens)")
        lines.append(f"{'positions':>17}  {'NLL':>8}  {'ppl':>10}")
        for b in perplexity["buckets"]:
            lines.append(f"{b['start']:>8}-{b['end'] - 1:<8}  {b['mean_nll']:8.4f}  {b['ppl']:10.3f}")
        lines.append(f"{'all':>17}  {perplexity['mean_nll']:8.4f}  {perplexity['ppl']:10.3f}")
    return "\n".join(lines)


def _cell(needle: Dict, length: int, depth: float) -> Dict:
    return next(c for c in needle["cells"] if c["length"] == length and c["depth"] == depth)


_RECORDED = ("index", "block_size", "top_p", "last_q", "min_vertical", "max_vertical", "min_slash", "max_slash",
             "sink_tokens", "local_window")


def _config_json(config, dense_layers: int) -> Dict:
    return dict({name: getattr(config, name) for name in _RECORDED}, dense_layers=dense_layers)


def _write_json(path: str, data: Dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
