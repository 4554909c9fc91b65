"""Does sparse training learn like dense? Loss and long-range retrieval, four attentions compared.

The same small megatron-core GPT (RoPE, GQA) trains from the same seed on the same synthetic
corpus (``corpus.py``: word-completion filler plus key-value needles queried at
the end of each sequence, stored in Megatron's indexed-dataset format) with the same token budget,
once per attention (``--run``):

* ``dense``: exact causal attention (the dense index);
* ``mtraining``: MTraining's vertical-slash index (``vs``, top-p 0.9, vertical floor
  ``--min-vertical`` 256, the default; 0 is the paper's pure top-p);
* ``moba``: MoBA's gated key blocks (``MTrainingConfig(index="moba")``: MoBA blocks of
  ``--moba-block-size`` tokens, each query block attends its own and the best of the others by
  mean query against mean key, ``--moba-top-k`` in all);
* ``xattn``: XAttention's antidiagonal-scored blocks (``index="xattn"``: blocks of
  ``--xattn-block-size`` tokens scored with stride ``--xattn-stride``, each query block keeps its
  best blocks up to ``--xattn-threshold`` of its score mass).

All four go through ``MTrainingAttention``, so the index is the only difference. Training follows
a short-to-long schedule (``--phases``, the same token count per iteration). Then each model is
evaluated:

* held-out LM loss on unseen sequences at the longest length;
* needle-in-a-haystack retrieval accuracy on a depth x length grid (a query counts when all its
  value tokens are predicted exactly), with dense attention at inference for every model (what
  the weights learned) and also with its own sparse index (the dense model: MTraining's);
* the per-layer index density over training (the sparsity dynamics).

What to compare against (the MTraining paper, which trains with MoBA's and XAttention's indices
beside its own):
MoBA's loss falls faster than the others at first and ends higher than dense attention and
MTraining; XAttention's index trains, but runs slower under the context-parallel ring, its
selected blocks spread unevenly over the ring's steps (step imbalance). This benchmark measures
the learning side only; the ring benchmarks (``ring.py``) measure speed.

    python benchmarks/quality.py --run dense     --out q_dense.json      # one process, one device
    python benchmarks/quality.py --run mtraining --out q_mtraining.json  # likewise moba, xattn
    python benchmarks/quality.py --merge q_dense.json q_mtraining.json  # -> results/quality.json + plots
    python benchmarks/quality.py --merge q_dense.json q_mtraining.json q_moba.json q_xattn.json

Context extension, the paper's protocol: pretrain dense at a short length and save the model, then
extend it to a length 8-16x longer from that same model, once with dense attention and once with
MTraining, on the same tokens; the merge compares them as above (its ``extended_from`` names the
base) and adds the held-out loss by position span at the longest length:

    python benchmarks/quality.py --run dense --phases 2048:2000 --save-model base.pt --out q_base.json
    python benchmarks/quality.py --run dense --phases 32768:300 --init-from base.pt --out q_ext_dense.json
    python benchmarks/quality.py --run mtraining --phases 32768:300 --init-from base.pt --out q_ext_mt.json
    python benchmarks/quality.py --merge q_ext_dense.json q_ext_mt.json --out results/quality_extension.json

The merge takes the dense result first, then any of the mtraining, moba and xattn results. With
the mtraining one, the summary keeps the keys of the MTraining against dense comparison
(``final_loss_gap``, ``mtraining_held_out_loss``, ...); each other run adds the same figures
under its own name (``moba_final_loss_gap``, ``xattn_held_out_loss``, ...) and ``runs`` lists
them. Without the mtraining run give ``--out`` (``make_tables.py`` renders the results'
``quality*.json`` as MTraining against dense).

The MoBA and XAttention block sizes must divide the sequence lengths (a length shorter than
one MoBA block is a single MoBA block). With the config's defaults (MoBA blocks of 4096 tokens,
top-12) MoBA attends densely up to 48K tokens: the default schedule, which ends at 32K, then
compares nothing sparse, so pick the MoBA flags for the lengths trained.

Recipe. Earlier recipes used ``pair`` needles (``KEY k v VAL``, answered by an induction circuit:
a previous-token head, then a head matching the query's key against it). Small models learn that
only after a long plateau: started at 4K tokens with one needle per 1K the dense model stayed at
chance for 2500 iterations; at 128 tokens with 48 needles per 1K and answer tokens weighted 20x it
learned within 4000 iterations only to pick among the symbols in context (answer loss 3.3 against
chance 4.85 on an H200), which fell back to chance at 1K tokens. The defaults therefore use
``fact`` needles (``--needle-format fact``: one token per needle stands for its key-value pair,
queried as ``QUERY key value ANS``): one attention head that matches the query's key against the
facts answers it, so the test is the far-back retrieval itself. On the CPU a 2-layer, 128-wide
model learned it at 128 tokens in ~300 iterations (answer loss 3.04 -> 0.03) and kept it at 512.
The answer tokens still weigh 20x in the training loss (``--answer-loss-weight``; every reported
loss is the plain LM loss, ``answer_loss`` in the curve is the loss on answer tokens alone), the
RoPE base is Qwen2.5's 1e6 (its slowest frequencies barely turn over 32K tokens, so the key match
learned short still holds far back), and the context grows 128 -> 1K -> 4K -> 32K.

Packed documents (``--packed``): every training and evaluation sequence is several
documents (``--documents MIN:MAX`` per sequence, lengths drawn from the seed;
``corpus.PackedConfig``), each a self-contained corpus sequence with its own
needles and its own queries at its end. Attention stays within documents in every run: each
forward hands its documents to every MTrainingAttention layer as ``cu_seqlens`` (never an S x S
mask) the way Megatron's ``--reset-attention-mask --reset-position-ids`` data does: the position
ids restart at each document's ``BOS`` and ``packing.prepare_batch`` turns them into the current
batch's documents, which every layer reads (the dense run: the dense index with documents; the
MTraining run: the ``vs`` index with per-document approximator statistics; the MoBA run: its
gate skips the MoBA blocks that end before a query block's document). XAttention's builder does
not score packed documents, so ``--run xattn --packed`` is refused. The rows of one
iteration share their documents (MTraining's ``cu_seqlens`` is shared by the micro-batch). The
retrieval probes put one needle per document, all with the SAME key and pairwise different
values: a query must be answered from its own document, and an answer equal to an earlier
document's value counts as a distractor hit (``distractor_rate``: ~0 with document masking; the
same probes without the documents, ``retrieval_no_document_mask``, show what the mask keeps
out). The merge of packed runs writes ``results/quality_packed.json``; its ``mean_density`` counts
document-causal pairs.

    python benchmarks/quality.py --run dense --packed --out qp_dense.json   # likewise mtraining, moba, then
    python benchmarks/quality.py --merge qp_dense.json qp_mtraining.json     # -> results/quality_packed.json

(``scripts/gpu_quality.sh`` runs the two trainings side by side on two GPUs; ``PACKED=1`` the
packed ones.) GPUs train under bf16 autocast with fp32 weights (``--no-bf16``: fp32/TF32); on the
CPU use tiny ``--phases`` / model flags (the tests do).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import packed_active_pairs, run_metadata, write_json  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.config import BLOCK_SIZES, VERTICAL_FLOOR  # noqa: E402
from corpus import (  # noqa: E402
    BOS, KEY, NEEDLE_FORMATS, PROLONG_MIX, CorpusConfig, PackedConfig, answer_target_mask, make_needle_probe,
    make_packed_probe, make_packed_sequence, query_target_positions, reset_position_ids, retrieval_accuracy,
    write_indexed_dataset,
)
from megatron_mtraining.block_index import BlockIndex  # noqa: E402
from megatron_mtraining.index import VSIndex  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HELD_OUT_START = 10_000_000  # corpus indices of held-out sequences (training uses 0, 1, 2, ...)
PHASES = "128:800,1024:400,4096:400,32768:800"
# Packed: 3-8 documents per sequence, so the first phase is longer (documents of ~64-170 tokens,
# like the unpacked recipe's first phase); the same tokens per iteration and iterations.
PACKED_PHASES = "512:800,2048:400,8192:400,32768:800"
RUNS = ("dense", "mtraining", "moba", "xattn")
# The index each run trains with, and the one it is also evaluated with (the dense model: MTraining's).
TRAIN_INDEX = {"dense": "dense", "mtraining": "vs", "moba": "moba", "xattn": "xattn"}
SPARSE_INFERENCE_INDEX = {"dense": "vs", "mtraining": "vs", "moba": "moba", "xattn": "xattn"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=RUNS)
    p.add_argument("--merge", nargs="+", metavar="RESULT_JSON",
                   help="the dense result, then 1 to 3 of the mtraining, moba and xattn results")
    p.add_argument("--out", default=None)
    p.add_argument("--phases", default=None,
                   help=f"training schedule, comma-separated SEQ_LEN:ITERATIONS (default {PHASES}; with --packed "
                        f"{PACKED_PHASES})")
    p.add_argument("--packed", action="store_true",
                   help="packed documents: every sequence is several corpus documents, attention masked at their "
                        "boundaries (cu_seqlens) in both runs; the merge writes results/quality_packed.json")
    p.add_argument("--documents", default="3:8", metavar="MIN:MAX",
                   help="with --packed: documents per sequence (uniform in [MIN, MAX], fewer where "
                        "MAX x --min-document-len does not fit; at most the number of values)")
    p.add_argument("--document-mix", default=None, metavar="prolong|L1,L2,...",
                   help="with --packed: every sequence is this mix of documents scaled to its length, in a random "
                        "order, instead of --documents (prolong: the 128K packed benchmark mix, long documents "
                        "holding most of the pairs; the shortest merge where they would be below "
                        "--min-document-len)")
    p.add_argument("--min-document-len", type=int, default=64, help="with --packed: the shortest document")
    p.add_argument("--tokens-per-iteration", type=int, default=16384,
                   help="batch = max(1, this // SEQ_LEN) sequences per iteration")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--rotary-base", type=int, default=1_000_000,
                   help="RoPE base (Qwen2.5's 1e6: its slowest frequencies barely turn over 32K tokens, so a "
                        "key match learned on short sequences still holds far back)")
    p.add_argument("--needles-per-1k", type=float, default=48.0,
                   help="needles per 1024 tokens (at least 2, at most one per distinct key)")
    p.add_argument("--queries", type=int, default=6, help="queries per sequence (at most the needles)")
    p.add_argument("--needle-format", choices=NEEDLE_FORMATS, default="fact",
                   help="fact: one token per needle stands for its (key, value) pair (one attention head "
                        "retrieves it); pair: KEY key.. value.. VAL needles (an induction circuit)")
    p.add_argument("--key-len", type=int, default=1, help="tokens per needle key")
    p.add_argument("--value-len", type=int, default=1, help="tokens per needle value (all must be right)")
    p.add_argument("--answer-loss-weight", type=float, default=20.0,
                   help="training-loss weight of the answer (retrieval target) tokens relative to the others "
                        "(1: plain LM loss); reported held-out losses are always the plain LM loss")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--dense-max-seq-length", type=int, default=0,
                   help="sparse runs: phases of at most this many tokens attend densely "
                        "(MTrainingConfig.dense_max_seq_length; 0: never)")
    p.add_argument("--last-q", type=int, default=128)
    p.add_argument("--min-vertical", type=int, default=VERTICAL_FLOOR,
                   help="lower clamp of each head's vertical budget (MTrainingConfig.min_vertical; "
                        "0: the paper's pure top-p budget)")
    p.add_argument("--block-size", type=int, default=64,
                   help="index block size of the dense, mtraining and moba runs")
    defaults = MTrainingConfig()
    p.add_argument("--moba-block-size", type=int, default=defaults.moba_block_size,
                   help="moba run: tokens per MoBA key block, a multiple of --block-size (MTrainingConfig."
                        f"moba_block_size, default {defaults.moba_block_size})")
    p.add_argument("--moba-top-k", type=int, default=defaults.moba_top_k,
                   help="moba run: MoBA blocks each query block attends, its own included (MTrainingConfig."
                        f"moba_top_k, default {defaults.moba_top_k})")
    p.add_argument("--xattn-block-size", type=int, default=defaults.block_size,
                   help="xattn run: index block size, the blocks XAttention scores and keeps (MTrainingConfig."
                        f"block_size, default {defaults.block_size}; the paper's 128)")
    p.add_argument("--xattn-stride", type=int, default=defaults.xattn_stride,
                   help="xattn run: antidiagonal stride, a power of two dividing --xattn-block-size "
                        f"(MTrainingConfig.xattn_stride, default {defaults.xattn_stride})")
    p.add_argument("--xattn-threshold", type=float, default=defaults.xattn_threshold,
                   help="xattn run: share of each query block's score mass its key blocks reach, in (0, 1] "
                        f"(MTrainingConfig.xattn_threshold, default {defaults.xattn_threshold})")
    p.add_argument("--eval-lengths", default="4096,16384,32768")
    p.add_argument("--eval-depths", default="0.05,0.25,0.45,0.65,0.85")
    p.add_argument("--eval-probes", type=int, default=16, help="probes per (length, depth) cell")
    p.add_argument("--held-out", type=int, default=4, help="held-out sequences at the longest length")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="fp32 (TF32) instead of bf16 autocast on GPUs (the CPU always runs fp32)")
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="stop training early past this (recorded as stopped_at_iteration) so a run always evaluates")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-model", metavar="PATH",
                   help="write the trained model (state dict and shape flags) to PATH: the base of --init-from")
    p.add_argument("--init-from", metavar="PATH",
                   help="start from a --save-model file instead of the seed's initial weights (context "
                        "extension: the same base, extended with each attention on the same tokens)")
    p.add_argument("--position-buckets", type=int, default=8,
                   help="held-out loss at the longest length in this many equal spans of positions")
    args = p.parse_args(argv)
    if (args.run is None) == (args.merge is None):
        p.error("give exactly one of --run and --merge")
    if args.merge is not None and not 2 <= len(args.merge) <= 4:
        p.error(f"--merge takes 2 to 4 results (dense, then any of mtraining, moba, xattn), got {len(args.merge)}")
    if args.run == "xattn" and args.packed:
        p.error("--run xattn --packed: XAttention's index builder (block_approx.xattn_index) does not score "
                "packed documents (cu_seqlens); run xattn unpacked, or compare mtraining and moba packed")
    if args.phases is None:
        args.phases = PACKED_PHASES if args.packed else PHASES
    if args.run:
        if not args.answer_loss_weight > 0:
            p.error(f"--answer-loss-weight must be positive, got {args.answer_loss_weight}")
        try:
            schedule = phases(args.phases)
            check_index_flags(args, [s for s, _ in schedule] + [int(x) for x in args.eval_lengths.split(",")])
            if args.packed:
                documents_range(args.documents)
                document_mix(args.document_mix)
                for seq_len in [s for s, _ in schedule] + [int(x) for x in args.eval_lengths.split(",")]:
                    cfg = packed_config(args, seq_len)
                    if cfg.most_documents > cfg.num_values:
                        flag = "--document-mix" if cfg.document_mix else "--documents"
                        raise ValueError(f"{flag}: the packed probes need a distinct value per document, "
                                         f"at most {cfg.num_values} documents with this vocabulary")
        except ValueError as err:
            p.error(str(err))
    return args


def phases(spec: str):
    """``"4096:300,32768:150"`` -> [(4096, 300), (32768, 150)]; ValueError naming the flag otherwise."""
    out = []
    for item in spec.split(","):
        try:
            seq, iters = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--phases: expected SEQ_LEN:ITERATIONS items separated by commas, got {item!r}") from None
        if seq <= 0 or iters <= 0:
            raise ValueError(f"--phases: sequence length and iterations must be positive, got {item!r}")
        out.append((seq, iters))
    return out


def corpus_config(args, seq_len: int) -> CorpusConfig:
    """Sequences of ``seq_len + 1`` tokens: the model reads ``seq_len`` (a multiple of the block
    size) and predicts the next token at each of them."""
    fields = dict(vocab_size=args.vocab_size, seq_len=seq_len + 1, key_len=args.key_len, value_len=args.value_len,
                  seed=args.seed, needle_format=getattr(args, "needle_format", "pair"))  # older results: pair
    needles = max(2, int(args.needles_per_1k * seq_len / 1024))
    # At most one needle per distinct key (num_keys depends on neither count).
    needles = min(needles, CorpusConfig(**fields, num_needles=1, num_queries=1).num_keys)
    return CorpusConfig(**fields, num_needles=needles, num_queries=min(args.queries, needles))


def documents_range(spec: str):
    """``"3:8"`` -> (3, 8); ValueError naming the flag otherwise."""
    try:
        lo, hi = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--documents: expected MIN:MAX, got {spec!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--documents: expected 1 <= MIN <= MAX, got {spec!r}")
    return lo, hi


def document_mix(spec):
    """``None`` -> (); ``"prolong"`` -> ``PROLONG_MIX``; ``"4,2,1"`` -> (4.0, 2.0, 1.0); ValueError
    naming the flag otherwise."""
    if spec is None:
        return ()
    if spec == "prolong":
        return PROLONG_MIX
    try:
        mix = tuple(float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--document-mix: expected prolong or comma-separated lengths, got {spec!r}") from None
    if not all(math.isfinite(x) and x > 0 for x in mix):
        raise ValueError(f"--document-mix: lengths must be positive, got {spec!r}")
    return mix


def packed_config(args, seq_len: int) -> PackedConfig:
    """Packed sequences of ``seq_len + 1`` tokens (as ``corpus_config``), documents per ``--documents``
    or ``--document-mix``; each document gets ``--needles-per-1k`` needles and up to ``--queries`` queries."""
    lo, hi = documents_range(args.documents)
    try:
        return PackedConfig(vocab_size=args.vocab_size, seq_len=seq_len + 1, min_documents=lo, max_documents=hi,
                            min_document_len=args.min_document_len, needles_per_1k=args.needles_per_1k,
                            queries=args.queries, key_len=args.key_len, value_len=args.value_len, seed=args.seed,
                            needle_format=args.needle_format,
                            document_mix=document_mix(getattr(args, "document_mix", None)))  # older results: none
    except ValueError as err:
        raise ValueError(f"--packed at {seq_len} tokens: {err}") from None


def mtraining_config(args, run: str) -> MTrainingConfig:
    """The run's attention settings: its index (``TRAIN_INDEX``) and that index's flags (the
    xattn run's blocks are ``--xattn-block-size`` tokens, the others' ``--block-size``). The other
    block-sparse flags keep the config's defaults, so they cannot fail another run."""
    fields = {"block_size": args.block_size}
    if run == "moba":
        fields.update(moba_block_size=args.moba_block_size, moba_top_k=args.moba_top_k)
    elif run == "xattn":
        fields.update(block_size=args.xattn_block_size, xattn_stride=args.xattn_stride,
                      xattn_threshold=args.xattn_threshold)
    return MTrainingConfig(index=TRAIN_INDEX[run], top_p=args.top_p, last_q=args.last_q,
                           min_vertical=args.min_vertical, dense_max_seq_length=args.dense_max_seq_length, **fields)


def check_index_flags(args, lengths):
    """ValueError naming the flag where the run's index cannot be built at one of ``lengths`` (the
    phases and the evaluation lengths), here rather than deep inside the training."""
    lengths = sorted(set(lengths))
    if args.run == "xattn":
        flag, block = "--xattn-block-size", args.xattn_block_size
        if block not in BLOCK_SIZES:
            raise ValueError(f"--xattn-block-size must be one of {BLOCK_SIZES}, got {block}")
        stride = args.xattn_stride
        if stride < 1 or stride & (stride - 1) or block % stride:
            raise ValueError(f"--xattn-stride must be a power of two dividing --xattn-block-size ({block}), "
                             f"got {stride}")
        if not 0.0 < args.xattn_threshold <= 1.0:
            raise ValueError(f"--xattn-threshold must be in (0, 1], got {args.xattn_threshold}")
    else:
        flag, block = "--block-size", args.block_size
    bad = [n for n in lengths if n % block]
    if bad:
        raise ValueError(f"{flag} {block} must divide every --phases and --eval-lengths length; it does not "
                         f"divide {', '.join(map(str, bad))}")
    if args.run == "moba":
        moba = args.moba_block_size
        if moba < 1 or moba % block:
            raise ValueError(f"--moba-block-size must be a positive multiple of --block-size ({block}), got {moba}")
        if args.moba_top_k < 1:
            raise ValueError(f"--moba-top-k must be >= 1 (the query block's own MoBA block), got {args.moba_top_k}")
        # A sequence shorter than one MoBA block is one MoBA block; a longer one must be whole blocks.
        bad = [n for n in lengths if n > moba and n % moba]
        if bad:
            raise ValueError(f"--moba-block-size {moba} must divide every --phases and --eval-lengths length "
                             f"longer than one MoBA block; it does not divide {', '.join(map(str, bad))}")
    try:
        mtraining_config(args, args.run)
    except ValueError as err:
        raise ValueError(f"--run {args.run}: {err}") from None


# ---------------------------------------------------------------------------- set-up


def init_single_process(device):
    """A world of one process with megatron's parallel state (the model code needs it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tmp = tempfile.mkdtemp(prefix="mtraining-quality-")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
    shims = None
    if device.type == "cpu":
        from megatron_mtraining.testing.cpu_shims import apply_cpu_shims

        shims = apply_cpu_shims()
    parallel_state.initialize_model_parallel()
    return shims


def build_model(args, run: str, max_len: int, device):
    from megatron_mtraining.testing.gpt import build_small_gpt

    torch.manual_seed(args.seed)  # the same initial weights for both runs
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    return build_small_gpt(mtraining_config(args, run), num_layers=args.num_layers, hidden_size=args.hidden_size,
                           num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                           vocab_size=args.vocab_size, seq_length=max_len,
                           rotary_base=args.rotary_base).to(device)


# The flags that decide a --save-model file's tensors: an --init-from run must give the same.
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size", "rotary_base")


def save_model(args, model, path):
    torch.save({"state_dict": model.state_dict(), "model_flags": {k: getattr(args, k) for k in MODEL_FLAGS},
                "run": args.run, "phases": args.phases}, path)


def init_from(args, model, path):
    """Load a --save-model file into ``model``; SystemExit naming the flags that differ."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    differ = [f"--{k.replace('_', '-')} {getattr(args, k)} (the base: {v})" for k, v in saved["model_flags"].items()
              if getattr(args, k) != v]
    if differ:
        raise SystemExit(f"--init-from {path} holds another model: " + ", ".join(differ))
    missing, unexpected = model.load_state_dict(saved["state_dict"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SystemExit(f"--init-from {path}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return {"path": os.path.abspath(path), "run": saved["run"], "phases": saved["phases"]}


def write_training_data(args, schedule, folder):
    """One Megatron indexed dataset per phase (exactly the sequences that phase trains on). Packed:
    the ``batch`` rows of each iteration share one layout of documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    datasets = []
    for i, (seq_len, iters) in enumerate(schedule):
        batch = max(1, args.tokens_per_iteration // seq_len)
        start = time.time()
        config = packed_config(args, seq_len) if args.packed else corpus_config(args, seq_len)
        prefix = write_indexed_dataset(os.path.join(folder, f"phase{i}_{seq_len}"), config,
                                       iters * batch, start_index=i * 1_000_000,
                                       workers=min(16, len(os.sched_getaffinity(0))),
                                       **({"rows_per_layout": batch} if args.packed else {}))
        datasets.append((IndexedDataset(prefix), seq_len, iters, batch))
        print(f"[quality] {args.run}: phase {i} data, {iters * batch} sequences of {seq_len} tokens, "
              f"written in {time.time() - start:.1f} s", flush=True)
    return datasets


def core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


@contextlib.contextmanager
def index_override(model, index: str):
    """Evaluate with another index kind ("dense": exact attention; "vs": MTraining's; "moba",
    "xattn": the block-sparse ones) whatever index the model trained with; the other settings of
    the run stay (its block sizes among them), and so do layers built dense."""
    indexers = [a.indexer for a in core_attentions(model) if not a.indexer.dense]
    saved = [ix.mtraining_config for ix in indexers]
    for ix in indexers:
        ix.mtraining_config = dataclasses.replace(ix.mtraining_config, index=index)
    try:
        yield
    finally:
        for ix, cfg in zip(indexers, saved):
            ix.mtraining_config = cfg


def dense_inference(model):
    return index_override(model, "dense")


def needle_column(cfg: CorpusConfig, tokens: torch.Tensor) -> int:
    """Position of the token that holds a probe's answer: its fact token, or its first value token."""
    start = int((tokens == KEY).nonzero()[0, 0])  # a probe has one needle, KEY opens it
    return start + 1 + (0 if cfg.needle_format == "fact" else cfg.key_len)


# ---------------------------------------------------------------------------- train / eval


def autocast(args, device):
    """bf16 autocast on GPUs (fp32 master weights and optimizer; megatron-core's linear layers
    support CUDA autocast); a no-op on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.bf16)


def model_forward(model, inputs, args, labels=None, documents: bool = True):
    """The model on ``inputs`` [b, s]: logits, or with ``labels`` the per-token loss.

    Packed runs (``--packed``) first hand the batch's documents to every attention layer, as
    Megatron's ``--reset-attention-mask --reset-position-ids`` data does: the position ids restart
    at each document's BOS, and ``packing.prepare_batch`` (``run`` configured those flags) turns
    them into the current batch's ``cu_seqlens``, which every MTrainingAttention of this forward
    reads (megatron-core's RoPE does not read position ids: it rotates by global positions, which
    within a document is the same). ``documents=False`` clears them: attention across documents."""
    position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    if getattr(args, "packed", False):
        from megatron_mtraining.integration import packing

        if documents:
            position_ids = reset_position_ids(inputs)
            if packing.prepare_batch({"tokens": inputs, "position_ids": position_ids}) is None:
                raise RuntimeError("quality.py --packed: packing.configure_packing(reset_attention_mask=True, "
                                   "reset_position_ids=True) must be set before the forward")
        else:
            packing.clear_batch_documents()
    with autocast(args, inputs.device):
        return model(inputs, position_ids, None, labels=labels)


def per_token_loss(model, tokens, args):
    """Cross entropy [b, s - 1]: column p is the loss of predicting ``tokens[:, p + 1]`` from ``tokens[:, :p + 1]``."""
    return model_forward(model, tokens[:, :-1], args, labels=tokens[:, 1:]).float()


def packed_label_masks(tokens: torch.Tensor, value_len: int):
    """(answers, loss_mask), bool [b, s - 1] aligned with ``per_token_loss`` columns, for packed
    sequences: ``answers`` where the label is an answer token of a query (any document);
    ``loss_mask`` False where the label is the next document's BOS (a column that crosses a
    document boundary: not trained on, not in the reported LM loss)."""
    answers = answer_target_mask(tokens, value_len)[:, 1:]
    return answers, tokens[:, 1:] != BOS


def masked_training_loss(per_token, answers, weight, loss_mask):
    """``training_loss`` for per-row masks [b, s]: the mean over ``loss_mask`` columns, answer
    columns weighted ``weight`` times the others."""
    w = loss_mask.to(per_token.dtype) * (1.0 + (weight - 1.0) * answers.to(per_token.dtype))
    return (per_token * w).sum() / w.sum()


def document_density(index, cu_seqlens: torch.Tensor, seq_len: int, rows: int = 2) -> float:
    """Active (query, key) pairs of ``index`` (a ``VSIndex`` or a ``BlockIndex``) within documents
    over the document-causal pairs (mean over heads and the first ``rows`` batch elements; 1 for
    the dense index)."""
    n = min(rows, index.batch)
    if isinstance(index, BlockIndex):
        pairs = block_document_pairs(BlockIndex(index.key_blocks[:n], index.n_key_blocks[:n], index.block_size),
                                     cu_seqlens, seq_len)
    else:
        sub = VSIndex(index.slash[:n], index.n_slash[:n], index.vertical[:n], index.n_vertical[:n], index.block_size)
        pairs = packed_active_pairs(sub, cu_seqlens, seq_len)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=pairs.device, dtype=torch.float64)
    return float(pairs.mean() / (lengths * (lengths + 1) / 2).sum())


def block_document_pairs(index: BlockIndex, cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """float64 ``[b, h]``: the (query, key) pairs a block index keeps within documents, counted per
    block pair from tokens-per-(block, document) (``packed_active_pairs`` for a ``BlockIndex``):
    key block ``kb < qb`` keeps sum over documents of cnt[qb, d] * cnt[kb, d], the diagonal block
    cnt[qb, d] (cnt[qb, d] + 1) / 2."""
    B, nb = index.block_size, index.num_blocks
    device = index.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    pos = torch.arange(seq_len, device=device)
    doc = torch.searchsorted(cu, pos, right=True) - 1
    cnt = torch.zeros(nb, cu.numel() - 1, dtype=torch.float64, device=device)
    cnt.index_put_((pos // B, doc), torch.ones(seq_len, dtype=torch.float64, device=device), accumulate=True)
    per_pair = (cnt @ cnt.T).tril(-1) + torch.diag((cnt * (cnt + 1) / 2).sum(-1))  # [qb, kb]
    return (index.to_mask().to(torch.float64) * per_pair).sum((-1, -2))


def layer_densities(model, seq_len: int, args):
    """Per layer, the density of its last index: of causal pairs, or (packed) of document-causal pairs."""
    if not getattr(args, "packed", False):
        return [a.last_index.density(seq_len).float().mean().item() for a in core_attentions(model)]
    from megatron_mtraining.integration import packing

    cu = packing.current_batch_documents().cu_seqlens
    return [document_density(a.last_index, cu, seq_len) for a in core_attentions(model)]


def answer_label_mask(cfg: CorpusConfig, device) -> torch.Tensor:
    """Bool [cfg.seq_len - 1], aligned with ``per_token_loss`` columns: True where the label is an
    answer (value) token of a query. Every sequence of ``cfg`` ends with the same query block."""
    mask = torch.zeros(cfg.seq_len, dtype=torch.bool)
    mask[torch.from_numpy(query_target_positions(cfg))] = True
    return mask[1:].to(device)


def lm_loss(model, tokens, args):
    return per_token_loss(model, tokens, args).mean()


def training_loss(per_token, answers, weight):
    """Mean loss with the answer columns weighted ``weight`` times the others (``weight == 1``: the plain LM loss)."""
    if weight == 1.0:
        return per_token.mean()
    w = 1.0 + (weight - 1.0) * answers.to(per_token.dtype)
    return (per_token * w).sum(-1).mean() / w.sum()


def lr_at(args, it, total):
    if it <= args.warmup:
        return args.lr * it / args.warmup
    progress = (it - args.warmup) / max(1, total - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args, model, datasets, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = sum(iters for _, _, iters, _ in datasets)
    curve, density_log, it = [], [], 0
    start = time.perf_counter()
    for dataset, seq_len, iters, batch in datasets:
        answers = None if args.packed else answer_label_mask(corpus_config(args, seq_len), device)
        for i in range(iters):
            if args.max_train_seconds and time.perf_counter() - start > args.max_train_seconds:
                print(f" stopping early at iteration {it} (--max-train-seconds {args.max_train_seconds})", flush=True)
                return curve, density_log, time.perf_counter() - start, it
            it += 1
            rows = [torch.from_numpy(dataset[i * batch + j].astype("int64")) for j in range(batch)]
            tokens = torch.stack(rows).to(device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(args, it, total)
            per_token = per_token_loss(model, tokens, args)
            if args.packed:  # the answers differ per iteration (documents), the rows share them
                answers, loss_mask = packed_label_masks(tokens, args.value_len)
                loss = masked_training_loss(per_token, answers, args.answer_loss_weight, loss_mask)
            else:
                loss = training_loss(per_token, answers, args.answer_loss_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if it % args.log_interval == 0 or it == 1 or it == total:
                # Plain LM loss and the loss on the answer tokens (chance: ln of the value count).
                if args.packed:
                    value, answer_value = per_token[loss_mask].mean().item(), per_token[answers].mean().item()
                else:
                    value, answer_value = per_token.mean().item(), per_token[:, answers].mean().item()
                densities = layer_densities(model, seq_len, args)
                curve.append({"iteration": it, "seq_len": seq_len, "loss": value, "answer_loss": answer_value})
                density_log.append({"iteration": it, "seq_len": seq_len, "density_per_layer": densities})
                print(f" iteration {it:>5}/{total} | seq {seq_len} | lm loss {value:.4f} | answer loss "
                      f"{answer_value:.4f} | density per layer "
                      + " ".join(f"{d:.3f}" for d in densities)
                      + f" | {time.perf_counter() - start:.0f} s", flush=True)
    return curve, density_log, time.perf_counter() - start, None


@torch.no_grad()
def held_out_losses(args, model, seq_len, device):
    """(plain LM loss, loss on the answer tokens alone) on held-out multi-needle sequences."""
    if getattr(args, "packed", False):
        return packed_held_out_losses(args, model, seq_len, device)
    cfg = corpus_config(args, seq_len)
    from corpus import make_sequence

    answers = answer_label_mask(cfg, device)
    per_token = [per_token_loss(model, make_sequence(cfg, HELD_OUT_START + i).tokens[None].to(device), args)
                 for i in range(args.held_out)]
    return (sum(x.mean().item() for x in per_token) / len(per_token),
            sum(x[:, answers].mean().item() for x in per_token) / len(per_token))


@torch.no_grad()
def held_out_loss_by_position(args, model, seq_len, device):
    """Held-out LM loss in ``--position-buckets`` equal spans of positions: [{start, end, loss}]
    (does the extended model use its new positions?)."""
    from corpus import make_sequence

    cfg = corpus_config(args, seq_len)
    per_token = torch.stack([per_token_loss(model, make_sequence(cfg, HELD_OUT_START + i).tokens[None].to(device),
                                            args)[0].float() for i in range(args.held_out)]).mean(0)
    edges = [round(seq_len * b / args.position_buckets) for b in range(args.position_buckets + 1)]
    return [{"start": a, "end": b, "loss": per_token[a:b].mean().item()} for a, b in zip(edges, edges[1:]) if b > a]


def held_out_loss(args, model, seq_len, device):
    return held_out_losses(args, model, seq_len, device)[0]


@torch.no_grad()
def retrieval_grid(args, model, device, coverage: bool = False):
    """Accuracy per (length, depth): one needle at that depth, queried at the end. ``coverage``:
    also the share of probes whose answer token each layer's index lets the answering query row
    attend to (in at least one head): whether the approximator found the needle."""
    if getattr(args, "packed", False):
        return packed_retrieval_grid(args, model, device, coverage)
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    depths = [float(x) for x in args.eval_depths.split(",")]
    grid, covered = [], {}
    for seq_len in lengths:
        cfg = corpus_config(args, seq_len)
        row = []
        hits = torch.zeros(args.num_layers)
        for depth in depths:
            correct = 0.0
            for i in range(args.eval_probes):
                sample = make_needle_probe(cfg, HELD_OUT_START + i, depth)
                tokens = sample.tokens[None].to(device)
                target = torch.zeros_like(tokens, dtype=torch.bool)
                target[0, sample.target_positions.to(device)] = True
                # logits[:, p] predicts tokens[:, p + 1]; pad one column to align with tokens.
                predictions = model_forward(model, tokens[:, :-1], args).argmax(-1)
                predictions = torch.cat([predictions, torch.zeros_like(tokens[:, :1])], 1)
                correct += retrieval_accuracy(predictions, tokens, target)
                if coverage:
                    # The first answer token is predicted at the row before it.
                    rows = sample.target_positions[:1] - 1
                    cols = torch.tensor([needle_column(cfg, sample.tokens)])
                    hits += torch.tensor([bool(a.last_index.covers(rows, cols, seq_len).any())
                                          for a in core_attentions(model)], dtype=torch.float32)
            row.append(correct / args.eval_probes)
        grid.append(row)
        covered[seq_len] = (hits / (len(depths) * args.eval_probes)).tolist()
    result = {"lengths": lengths, "depths": depths, "accuracy": grid,
              "mean": sum(map(sum, grid)) / (len(lengths) * len(depths))}
    if coverage:
        result["needle_coverage_per_layer"] = covered
    return result


@torch.no_grad()
def packed_held_out_losses(args, model, seq_len, device):
    """``held_out_losses`` on held-out packed sequences (the LM loss leaves out the columns that
    predict the next document's BOS)."""
    cfg = packed_config(args, seq_len)
    lm, answer = [], []
    for i in range(args.held_out):
        tokens = make_packed_sequence(cfg, HELD_OUT_START + i).tokens[None].to(device)
        per_token = per_token_loss(model, tokens, args)
        answers, loss_mask = packed_label_masks(tokens, args.value_len)
        lm.append(per_token[loss_mask].mean().item())
        answer.append(per_token[answers].mean().item())
    return sum(lm) / len(lm), sum(answer) / len(answer)


@torch.no_grad()
def packed_retrieval_grid(args, model, device, coverage: bool = False, documents: bool = True):
    """``retrieval_grid`` on packed probes (``make_packed_probe``): per (total length, depth of each
    needle in its own document), the share of queries answered with their own document's value.
    Every document after a probe's first has distractors (the same key, other values, in earlier
    documents): ``distractor_rate`` is the share of those queries answered with a distractor's
    value (chance: a distractor's share of the values). ``documents=False``: the same probes
    without document masking (attention across documents)."""
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    depths = [float(x) for x in args.eval_depths.split(",")]
    grid, distractor_grid, covered = [], [], {}
    queries = with_distractors = hits = 0
    chance = 0.0
    for seq_len in lengths:
        cfg = packed_config(args, seq_len)
        row, distractor_row = [], []
        layer_hits = torch.zeros(args.num_layers)
        cell_total = 0
        for depth in depths:
            correct = cell_queries = cell_distracted = cell_hits = 0
            for i in range(args.eval_probes):
                sample = make_packed_probe(cfg, HELD_OUT_START + i, depth)
                tokens = sample.tokens[None].to(device)
                predictions = model_forward(model, tokens[:, :-1], args, documents=documents).argmax(-1)[0].cpu()
                # The answer token at position t is predicted at t - 1.
                predicted = predictions[sample.target_positions - 1].view(sample.answers.shape)
                correct += int((predicted == sample.answers).all(-1).sum())
                cell_queries += len(sample.answers)
                for q, values in enumerate(sample.distractors):
                    if len(values):
                        cell_distracted += 1
                        cell_hits += int((predicted[q][None] == values).all(-1).any())
                        chance += len(values) / cfg.num_values ** args.value_len
                if coverage:
                    rows = sample.target_positions.view(sample.answers.shape)[:, 0] - 1
                    layer_hits += torch.tensor([float(a.last_index.covers(rows, sample.needle_positions, seq_len)
                                                      .any(1)[0].float().sum()) for a in core_attentions(model)])
            row.append(correct / cell_queries)
            distractor_row.append(cell_hits / max(1, cell_distracted))
            queries, with_distractors, hits = queries + cell_queries, with_distractors + cell_distracted, \
                hits + cell_hits
            cell_total += cell_queries
        grid.append(row)
        distractor_grid.append(distractor_row)
        covered[seq_len] = (layer_hits / cell_total).tolist()
    result = {"lengths": lengths, "depths": depths, "accuracy": grid,
              "mean": sum(map(sum, grid)) / (len(lengths) * len(depths)),
              "distractor_rate": hits / max(1, with_distractors), "distractor_grid": distractor_grid,
              "distractor_chance": chance / max(1, with_distractors), "queries": queries,
              "queries_with_distractors": with_distractors, "document_masking": documents}
    if coverage:
        result["needle_coverage_per_layer"] = covered
    return result


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":  # TF32 for what autocast leaves in fp32 (and for --no-bf16)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    schedule = phases(args.phases)
    max_len = max([s for s, _ in schedule] + [int(x) for x in args.eval_lengths.split(",")])
    shims = init_single_process(device)
    if args.packed:
        from megatron_mtraining.integration import packing

        # Documents reach the layers as Megatron's --reset-attention-mask --reset-position-ids data
        # do: model_forward restarts the position ids at each BOS, prepare_batch reads them.
        packing.configure_packing(reset_attention_mask=True, reset_position_ids=True)
    try:
        model = build_model(args, args.run, max_len, device)
        base = init_from(args, model, args.init_from) if args.init_from else None
        with tempfile.TemporaryDirectory(prefix="mtraining-corpus-") as folder:
            datasets = write_training_data(args, schedule, folder)
            print(f"[quality] {args.run}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
                  f"schedule {schedule}, {args.tokens_per_iteration} tokens/iteration, device {device}", flush=True)
            if args.run == "moba" and all(-(-n // args.moba_block_size) <= args.moba_top_k for n, _ in schedule):
                print(f"[quality] moba: at most {args.moba_top_k} MoBA blocks of {args.moba_block_size} tokens per "
                      "trained sequence: every query block attends all of them, the index is dense", flush=True)
            model.train()
            curve, density_log, train_s, stopped_at = train(args, model, datasets, device)
        model.eval()
        # The longest length actually trained (a --max-train-seconds stop may end before the last phase).
        longest = max(r["seq_len"] for r in curve)
        eval_lengths = sorted({longest, *(int(x) for x in args.eval_lengths.split(","))})
        result = {"run": args.run, "train_seconds": train_s, "stopped_at_iteration": stopped_at,
                  "loss_curve": curve, "density_log": density_log,
                  "settings": {k: v for k, v in vars(args).items() if k not in ("merge", "out")}}
        result["trained_length"] = longest
        result["extended_from"] = base
        if args.save_model:
            save_model(args, model, args.save_model)
        with dense_inference(model):
            losses = {n: held_out_losses(args, model, n, device) for n in eval_lengths}
            result["held_out_loss_by_length"] = {n: lm for n, (lm, _) in losses.items()}
            # Loss on the held-out sequences' answer tokens (chance: ln of the value count).
            result["held_out_answer_loss_by_length"] = {n: ans for n, (_, ans) in losses.items()}
            if not args.packed:
                result["held_out_loss_by_position"] = held_out_loss_by_position(args, model, longest, device)
            result["retrieval_dense_inference"] = retrieval_grid(args, model, device)
            if args.packed:  # the same probes with attention across documents: the distractors come into view
                result["retrieval_no_document_mask"] = packed_retrieval_grid(args, model, device, documents=False)
        # The run's own index at inference; the dense model gets MTraining's (it never trained with
        # one): does the index find the needles the model retrieves?
        result["sparse_inference_index"] = SPARSE_INFERENCE_INDEX[args.run]
        with index_override(model, result["sparse_inference_index"]):
            if args.run != "dense":
                result["held_out_loss_by_length_sparse_inference"] = {
                    n: held_out_loss(args, model, n, device) for n in eval_lengths}
            result["retrieval_sparse_inference"] = retrieval_grid(args, model, device, coverage=True)
        result["held_out_loss"] = result["held_out_loss_by_length"][longest]
        print(f"[quality] {args.run}: held-out loss {result['held_out_loss']:.4f} (answer tokens "
              f"{result['held_out_answer_loss_by_length'][longest]:.4f}, chance "
              f"{math.log(corpus_config(args, longest).num_values):.4f}), retrieval (dense inference) "
              f"{result['retrieval_dense_inference']['mean']:.3f}", flush=True)
        if args.packed:
            print(f"[quality] {args.run}: distractor rate {result['retrieval_dense_inference']['distractor_rate']:.3f} "
                  f"(without the document mask {result['retrieval_no_document_mask']['distractor_rate']:.3f}, "
                  f"chance {result['retrieval_dense_inference']['distractor_chance']:.3f})", flush=True)
    finally:
        from megatron.core import parallel_state
        import torch.distributed as dist

        if args.packed:
            packing.reset_packing()
        parallel_state.destroy_model_parallel()
        if shims is not None:
            shims.remove()
        dist.destroy_process_group()
    result["meta"] = run_metadata(device)
    out = args.out or f"quality_{args.run}.json"
    write_json(out, result)
    print(f"wrote {out}")


# ---------------------------------------------------------------------------- merge and plots

NAMES = {"dense": "dense", "mtraining": "MTraining", "moba": "MoBA", "xattn": "XAttention"}
_ABSENT = object()  # a summary key of a run not merged (None is a value: older results lack some)


def load_runs(paths):
    """{run: result} of the merged files in ``RUNS`` order; SystemExit unless the dense result
    comes first, then distinct sparse runs, all packed or none, on the same data and token budget."""
    loaded = []
    for path in paths:
        with open(path) as f:
            loaded.append(json.load(f))
    names = [r.get("run") for r in loaded]
    if names[0] != "dense" or not all(n in RUNS[1:] for n in names[1:]) or len(set(names)) != len(names):
        raise SystemExit("--merge expects the dense result first, then one to three of the mtraining, moba and "
                         f"xattn results, each once; got {', '.join(map(str, names))}")
    runs = dict(zip(names, loaded))
    packed = {n: bool(r["settings"].get("packed")) for n, r in runs.items()}
    if len(set(packed.values())) > 1:
        raise SystemExit("--merge: the runs must all be --packed or none; got "
                         + ", ".join(f"{n} {'packed' if p else 'unpacked'}" for n, p in packed.items()))
    for key in ("phases", "tokens_per_iteration", "seed"):
        values = {n: r["settings"].get(key) for n, r in runs.items()}
        if len(set(values.values())) > 1:
            raise SystemExit(f"--merge: the runs compare on the same data and token budget, but their "
                             f"--{key.replace('_', '-')} differ: {values}")
    return {n: runs[n] for n in RUNS if n in runs}


def run_figures(dense, run, longest):
    """One sparse run against the dense one at ``longest``: held-out losses and retrieval (dense
    inference; ``_sparse_inference``: its own index), the gaps to dense (loss relative, retrieval
    in points, dense minus the run), and its index density there (per layer, and the mean)."""
    density = [r for r in run["density_log"] if r["seq_len"] == longest][-1]["density_per_layer"]
    base, accuracy = _held_out(dense, longest), dense["retrieval_dense_inference"]["mean"]
    return {
        "final_loss_gap": (_held_out(run, longest) - base) / base,
        "retrieval_accuracy_gap": 100 * (accuracy - run["retrieval_dense_inference"]["mean"]),
        "retrieval_accuracy_gap_sparse_inference": 100 * (accuracy - run["retrieval_sparse_inference"]["mean"]),
        "retrieval_accuracy": run["retrieval_dense_inference"]["mean"],
        "retrieval_accuracy_sparse_inference": run["retrieval_sparse_inference"]["mean"],
        "held_out_loss": _held_out(run, longest),
        # Loss on the answer tokens of held-out multi-needle sequences (chance: ln of the value count).
        "held_out_answer_loss": run.get("held_out_answer_loss_by_length", {}).get(str(longest)),
        "mean_density": sum(density) / len(density),
        "density_per_layer": density,
    }


def merge(args):
    runs = load_runs(args.merge)
    dense = runs["dense"]
    sparse = {n: r for n, r in runs.items() if n != "dense"}
    if "mtraining" not in sparse and args.out is None:
        raise SystemExit("--merge without the mtraining result needs --out (make_tables.py renders the results' "
                         "quality*.json as MTraining against dense)")
    packed = bool(dense["settings"].get("packed"))
    bases = {n: (r.get("extended_from") or {}).get("path") for n, r in runs.items()}
    if len(set(bases.values())) > 1:
        raise SystemExit("--merge: the runs start from different weights (--init-from): "
                         + ", ".join(f"{n}: {b or 'the seed'}" for n, b in bases.items()))
    # The longest length every run trained at (a --max-train-seconds stop may end a run early).
    longest = min(r.get("trained_length", 0) for r in runs.values()) or \
        min(max(x["seq_len"] for x in r["density_log"]) for r in sparse.values())
    symbols = corpus_config(argparse.Namespace(**dense["settings"]), longest).num_values
    figures = {n: run_figures(dense, r, longest) for n, r in sparse.items()}
    # MTraining against dense: the keys make_tables.py and the targets read, left out where the
    # mtraining run is not merged.
    mt = lambda key: figures["mtraining"][key] if "mtraining" in figures else _ABSENT
    summary = {
        # Held-out loss at the longest length every run trained at (dense inference for all).
        "final_loss_gap": mt("final_loss_gap"),
        "retrieval_accuracy_gap": mt("retrieval_accuracy_gap"),
        "retrieval_accuracy_gap_sparse_inference": mt("retrieval_accuracy_gap_sparse_inference"),
        "dense_retrieval_accuracy": dense["retrieval_dense_inference"]["mean"],
        "mtraining_retrieval_accuracy": mt("retrieval_accuracy"),
        "mtraining_retrieval_accuracy_sparse_inference": mt("retrieval_accuracy_sparse_inference"),
        # The dense-trained model under MTraining's index, and per run and layer the share of
        # probes whose needle the run's index covers at the answering row (older results lack both).
        "dense_retrieval_accuracy_sparse_inference": dense.get("retrieval_sparse_inference", {}).get("mean"),
        "needle_coverage_per_layer": {
            n: r["retrieval_sparse_inference"]["needle_coverage_per_layer"] for n, r in runs.items()
            if "needle_coverage_per_layer" in r.get("retrieval_sparse_inference", {})},
        # Chance: guessing all value tokens of one query among the symbol tokens.
        "retrieval_chance": (1 / symbols) ** next(iter(sparse.values()))["settings"].get("value_len", 4),
        "dense_held_out_loss": _held_out(dense, longest),
        "mtraining_held_out_loss": mt("held_out_loss"),
        # Loss on the answer tokens of held-out multi-needle sequences (chance: ln of the value count).
        "dense_held_out_answer_loss": dense.get("held_out_answer_loss_by_length", {}).get(str(longest)),
        "mtraining_held_out_answer_loss": mt("held_out_answer_loss"),
        "answer_loss_chance": math.log(symbols),
        "mean_density": mt("mean_density"),
        "longest_context": longest,
        "held_out_length": longest,
        # Context extension (--init-from): the base every run started from, and the held-out loss
        # at the longest length by position span, per run.
        "extended_from": next(iter(runs.values())).get("extended_from"),
        "held_out_loss_by_position": {n: r["held_out_loss_by_position"] for n, r in runs.items()
                                      if "held_out_loss_by_position" in r},
        "train_seconds": {n: r["train_seconds"] for n, r in runs.items()},
        "stopped_at_iteration": {n: r.get("stopped_at_iteration") for n, r in runs.items()},
        "targets": {"final_loss_gap": "within 0.02", "retrieval_accuracy_gap": "<= 2 points",
                    "mean_density": "<= 0.10"} if "mtraining" in figures else _ABSENT,
    }
    summary = {key: value for key, value in summary.items() if value is not _ABSENT}
    others = [n for n in sparse if n != "mtraining"]
    if others:  # the block-sparse runs: the MTraining figures' names, prefixed with the run
        summary["runs"] = list(runs)
        for n in others:
            summary.update({f"{n}_{key}": value for key, value in figures[n].items()})
    if packed:
        summary.update(packed_summary(dense, sparse.get("mtraining"), {n: sparse[n] for n in others}))
    result = {"benchmark": "quality", "summary": summary, **runs}
    out = args.out or os.path.join(RESULTS_DIR, "quality_packed.json" if packed else "quality.json")
    write_json(out, result)
    plots = make_plots(result, os.path.splitext(out)[0])
    print(f"wrote {out} {' '.join(plots)}")
    for key, value in summary.items():
        if isinstance(value, list):
            print(f"{key:48s} " + " ".join(f"{x:.4f}" if isinstance(x, float) else str(x) for x in value))
        elif not isinstance(value, dict):
            print(f"{key:48s} {value:.4f}" if isinstance(value, float) else f"{key:48s} {value}")
    if packed:
        print(f"{'distractor_rate':48s} " + ", ".join(
            f"{NAMES[n]} {rate:.4f}" for n, rate in summary["distractor_rate"].items() if rate is not None))


def packed_summary(dense, sparse, others=None):
    """The summary keys of a packed merge (added to the unpacked ones, which keep their meaning;
    ``mean_density`` then counts document-causal pairs). ``sparse``: the mtraining result (None
    where it is not merged); ``others``: {run: result} of the other sparse runs."""
    others = others or {}
    runs = {"dense": dense, **({"mtraining": sparse} if sparse is not None else {}), **others}
    grid = lambda run, name: run.get(name, {})
    rate = lambda run, name: grid(run, name).get("distractor_rate")
    summary = {
        "packed": True,
        "documents": dense["settings"]["documents"],
        "document_mix": dense["settings"].get("document_mix"),
        "min_document_len": dense["settings"]["min_document_len"],
        # Queries answered with a distractor's value (a same-key needle of an earlier document),
        # dense inference for every run; ~0 with the document mask (the model cannot see them).
        "distractor_rate": {n: rate(r, "retrieval_dense_inference") for n, r in runs.items()},
        "dense_distractor_rate": rate(dense, "retrieval_dense_inference"),
    }
    for n, r in runs.items():
        if n != "dense":
            summary[f"{n}_distractor_rate"] = rate(r, "retrieval_dense_inference")
            summary[f"{n}_distractor_rate_sparse_inference"] = rate(r, "retrieval_sparse_inference")
    summary.update({
        # A guess among the values hits a distractor this often (what a model that cannot see
        # across documents, and does not know the answer, scores).
        "distractor_chance": grid(dense, "retrieval_dense_inference").get("distractor_chance"),
        # The same probes with attention across documents: what the mask keeps out.
        "distractor_rate_without_document_mask": {n: rate(r, "retrieval_no_document_mask") for n, r in runs.items()},
        "retrieval_accuracy_without_document_mask": {
            n: grid(r, "retrieval_no_document_mask").get("mean") for n, r in runs.items()},
        "density_of": "document-causal pairs",
    })
    if sparse is not None:
        summary["targets"] = {"final_loss_gap": "within 0.02", "retrieval_accuracy_gap": "<= 2 points",
                              "mean_density": "<= 0.10 (of document-causal pairs)",
                              "distractor_rate": "~0 for both (at most distractor_chance x the wrong answers)"}
    return summary


def _held_out(run, length):
    by_length = run.get("held_out_loss_by_length")
    return by_length[str(length)] if by_length and str(length) in by_length else run["held_out_loss"]


def run_label(name, settings):
    """A run's legend label with its index settings (the config's defaults where a result lacks them)."""
    defaults = MTrainingConfig()
    get = lambda key: settings.get(key, getattr(defaults, key))
    if name == "mtraining":
        return "MTraining (vs, top-p %.2f)" % settings["top_p"]
    if name == "moba":
        return f"MoBA (blocks {get('moba_block_size')}, top-{get('moba_top_k')})"
    if name == "xattn":
        return (f"XAttention (blocks {settings.get('xattn_block_size', defaults.block_size)}, stride "
                f"{get('xattn_stride')}, threshold {get('xattn_threshold')})")
    return "dense"


def make_plots(result, stem):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed")
        return []
    runs = {n: result[n] for n in RUNS if n in result}
    sparse = [n for n in runs if n != "dense"]
    dense = runs["dense"]
    packed = bool(result["summary"].get("packed"))
    paths = []

    # Left: the LM loss; right: the loss on the answer tokens alone (where retrieval shows).
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, ylabel in ((axes[0], "loss", "training LM loss"), (axes[1], "answer_loss", "answer-token loss")):
        for name, run in runs.items():
            points = [r for r in run["loss_curve"] if key in r]
            ax.plot([r["iteration"] for r in points], [r[key] for r in points],
                    label=run_label(name, run["settings"]), linewidth=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"training, same seed and data (phases SEQ:ITERATIONS {dense['settings']['phases']})")
    fig.tight_layout()
    paths.append(stem + "_loss.png")
    fig.savefig(paths[-1], dpi=120)

    # Dense inference for every model, then each sparse run under its own index. With one sparse
    # run, one row; with more, a row each (the dense model under MTraining's index below dense).
    trained = [(NAMES[n], runs[n]["retrieval_dense_inference"]) for n in runs]
    own = [(f"{NAMES[n]}, sparse inference", runs[n]["retrieval_sparse_inference"]) for n in sparse]
    if len(sparse) == 1:
        rows = [trained + own]
    else:
        rows = [trained, [("dense, MTraining's index", dense.get("retrieval_sparse_inference"))] + own]
    columns = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), columns, figsize=(13 if len(rows) == 1 else 4.3 * columns, 3.8 if
                                                          len(rows) == 1 else 4.3 * len(rows)), squeeze=False)
    if len(rows) > 1:
        fig.subplots_adjust(hspace=0.4)  # the lower row's titles clear the upper row's labels
    if packed:
        fig.subplots_adjust(top=0.8 if len(rows) == 1 else 0.88)  # room for the suptitle below
    used = []
    for r, row in enumerate(rows):
        for c in range(columns):
            ax = axes[r][c]
            title, g = row[c] if c < len(row) else (None, None)
            if g is None:
                ax.axis("off")
                continue
            im = ax.imshow(torch.tensor(g["accuracy"]).numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(g["depths"])), [f"{d:.0%}" for d in g["depths"]])
            ax.set_yticks(range(len(g["lengths"])), [f"{n // 1024}K" for n in g["lengths"]])
            ax.set_xlabel("needle depth")
            ax.set_ylabel("context length")
            ax.set_title(f"{title}: {g['mean']:.2f}")
            used.append(ax)
    fig.colorbar(im, ax=used, shrink=0.8, label="retrieval accuracy")
    if packed:
        rates = result["summary"]["distractor_rate"]
        fig.suptitle(f"packed: {dense['settings']['documents']} documents per sequence, needle depth within its "
                     "document; distractor rate " + ", ".join(
                         f"{NAMES[n]} {rate:.3f}" for n, rate in rates.items() if rate is not None))
    paths.append(stem + "_retrieval.png")
    fig.savefig(paths[-1], dpi=120)

    # Per layer for each sparse run; with several, first their mean over layers side by side.
    panels = (["mean"] if len(sparse) > 1 else []) + sparse
    fig, axes = plt.subplots(1, len(panels), figsize=(6 if len(panels) == 1 else 5 * len(panels), 4),
                             squeeze=False, sharey=True)
    ylabel = "index density" + (" (of document-causal pairs)" if packed else "")
    for ax, panel in zip(axes[0], panels):
        if panel == "mean":
            for name in sparse:
                log = runs[name]["density_log"]
                ax.plot([r["iteration"] for r in log],
                        [sum(r["density_per_layer"]) / len(r["density_per_layer"]) for r in log],
                        label=run_label(name, runs[name]["settings"]))
            ax.set_title("mean index density over the layers")
        else:
            log = runs[panel]["density_log"]
            for layer in range(len(log[0]["density_per_layer"])):
                ax.plot([r["iteration"] for r in log], [r["density_per_layer"][layer] for r in log],
                        label=f"layer {layer + 1}")
            ax.set_title(f"{NAMES[panel]} index density per layer over training")
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(stem + "_density.png")
    fig.savefig(paths[-1], dpi=120)
    return paths


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        merge(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
