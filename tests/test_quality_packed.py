"""benchmarks/quality.py --packed (issue 16) at toy scale on the CPU: packed documents reach every
attention layer as cu_seqlens in both runs, the merge writes quality_packed.json with its summary,
and the document mask is what keeps a query away from its distractors."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import quality  # noqa: E402

from corpus import (  # noqa: E402
    BOS, KEY, PROLONG_MIX, PackedConfig, make_packed_probe, make_packed_sequence, packed_document_lengths,
)

TOY = ["--packed", "--documents", "2:4", "--phases", "256:3,512:1", "--tokens-per-iteration", "512",
       "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--num-query-groups", "1",
       "--vocab-size", "256", "--eval-lengths", "512", "--eval-depths", "0.1,0.9", "--eval-probes", "1",
       "--held-out", "1", "--last-q", "64", "--warmup", "1", "--log-interval", "2"]

# Runs quality.py with a spy on what every MTrainingAttention forward attends with (the documents
# it reads: packing.documents_for_attention, called by MTrainingAttention._attend), and writes
# the records to SPY_OUT: [layer, global seq_len, batch, cu_seqlens or None] per layer forward.
SPY = """
import json, os, runpy, sys
sys.argv = [sys.argv[1]] + sys.argv[2:]
from megatron_mtraining.integration import packing
seen, real = [], packing.documents_for_attention
def spy(module, packed_seq_params, seq_len, batch_size):
    cu = real(module, packed_seq_params, seq_len, batch_size)
    seen.append([module.layer_number, seq_len, batch_size, None if cu is None else cu.cu_seqlens.tolist()])
    return cu
packing.documents_for_attention = spy
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    json.dump(seen, open(os.environ["SPY_OUT"], "w"))
"""


def run(*args, spy_out=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = os.path.join(REPO, "benchmarks", "quality.py")
    command = [sys.executable, script, *args]
    if spy_out is not None:
        env["SPY_OUT"] = spy_out
        command = [sys.executable, "-c", SPY, script, *args]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def input_cu_seqlens(cfg: PackedConfig, layout_index: int, seq_len: int):
    """The documents of a training row of ``seq_len + 1`` tokens as the model reads its first
    ``seq_len``: the layout's boundaries, the last document one token shorter."""
    ends = [0]
    for n in packed_document_lengths(cfg, layout_index):
        ends.append(ends[-1] + int(n))
    return ends[:-1] + [seq_len]


def test_packed_pipeline_hands_documents_to_every_layer(tmp_path):
    dense, sparse, merged = (str(tmp_path / name) for name in ("d.json", "m.json", "quality_packed.json"))
    seen = {}
    for name, out in (("dense", dense), ("mtraining", sparse)):
        spy = str(tmp_path / f"{name}_spy.json")
        run("--run", name, "--out", out, *TOY, spy_out=spy)
        with open(spy) as f:
            seen[name] = json.load(f)
    args = quality.parse_args(["--run", "dense", *TOY])
    for name, records in seen.items():
        # Training: 3 iterations of 2 rows x 256 tokens, then 1 of 1 x 512; each forward goes through
        # both layers, each with the documents of its iteration (phase p's layouts start at p * 10^6).
        expected = []
        for phase, (seq_len, iters) in enumerate(quality.phases(args.phases)):
            cfg = quality.packed_config(args, seq_len)
            batch = max(1, args.tokens_per_iteration // seq_len)
            for it in range(iters):
                cu = input_cu_seqlens(cfg, phase * 1_000_000 + it, seq_len)
                assert len(cu) >= 3  # at least two documents
                expected += [[layer, seq_len, batch, cu] for layer in (1, 2)]
        assert records[:len(expected)] == expected, name
        # Evaluation: every forward at 512 tokens, with the documents of its held-out sequence or probe,
        # except the probe grid without the document mask.
        evaluation = records[len(expected):]
        masked = [r for r in evaluation if r[3] is not None]
        unmasked = [r for r in evaluation if r[3] is None]
        assert len(unmasked) == 2 * 2  # 2 depths x 1 probe, 2 layers
        probes = {tuple(make_packed_probe(quality.packed_config(args, 512), quality.HELD_OUT_START, d)
                        .cu_seqlens[:-1].tolist()) + (512,) for d in (0.1, 0.9)}
        held_out = tuple(make_packed_sequence(quality.packed_config(args, 512), quality.HELD_OUT_START)
                         .cu_seqlens[:-1].tolist()) + (512,)
        assert {tuple(r[3]) for r in masked} == probes | {held_out}
        assert all(r[1:3] == [512, 1] for r in evaluation)

    out = run("--merge", dense, sparse, "--out", merged)
    assert "distractor_rate" in out
    with open(merged) as f:
        result = json.load(f)
    s = result["summary"]
    for key in ("final_loss_gap", "retrieval_accuracy_gap", "mean_density", "dense_distractor_rate",
                "mtraining_distractor_rate", "distractor_chance", "dense_retrieval_accuracy", "retrieval_chance"):
        assert isinstance(s[key], float), key
    assert set(s["distractor_rate"]) == {"dense", "mtraining"}
    assert all(0.0 <= v <= 1.0 for v in s["distractor_rate"].values())
    assert s["packed"] is True and s["documents"] == "2:4" and s["longest_context"] == 512
    assert 0 < s["mean_density"] <= 1
    d, m = result["dense"], result["mtraining"]
    assert d["loss_curve"][0]["loss"] == pytest.approx(m["loss_curve"][0]["loss"], rel=1e-4)
    # The dense index keeps every document-causal pair.
    assert all(x == pytest.approx(1.0) for r in d["density_log"] for x in r["density_per_layer"])
    grid = d["retrieval_dense_inference"]
    assert grid["queries"] >= 4 and grid["queries_with_distractors"] >= 2 and grid["document_masking"] is True
    assert d["retrieval_no_document_mask"]["document_masking"] is False
    for run_name in ("dense", "mtraining"):
        per_layer = s["needle_coverage_per_layer"][run_name]["512"]
        assert len(per_layer) == 2 and all(0.0 <= x <= 1.0 for x in per_layer)
    # The default output of a packed merge is quality_packed.json (quality.json stays the unpacked one).
    with pytest.raises(AssertionError):
        run("--merge", sparse, dense, "--out", merged)
    unpacked = dict(m, settings=dict(m["settings"], packed=False))
    with open(tmp_path / "unpacked.json", "w") as f:
        json.dump(unpacked, f)
    with pytest.raises(AssertionError):  # a packed and an unpacked run do not merge
        run("--merge", dense, str(tmp_path / "unpacked.json"), "--out", merged)


def test_document_mask_hides_the_distractors():
    """With attention across documents a query row that matches keys WOULD see the same-key
    needles of earlier documents (the distractors); with cu_seqlens it sees only its own."""
    from megatron_mtraining import VSIndex, reference_attention

    cfg = PackedConfig(vocab_size=2048, seq_len=512, min_documents=4, max_documents=4)
    s = make_packed_probe(cfg, 3, 0.5)
    n, k = cfg.seq_len, len(s.answers)
    dcfg = cfg.document_config(cfg.min_document_len)
    a = dcfg.fact_alphabet
    # A retrieval head: the query row (the query's key token, where the answer is predicted) and the
    # fact tokens get the embedding of their key; v reads the attention weights off (one-hot positions).
    q, key = torch.zeros(1, 1, n, n), torch.zeros(1, 1, n, n)
    rows = s.target_positions.view(k, -1)[:, 0] - 1
    tokens = s.tokens
    for p in rows.tolist():
        q[0, 0, p, int(tokens[p]) - dcfg.symbol_start] = 30.0
    for p in torch.nonzero(tokens == KEY).flatten().tolist():
        fact = int(tokens[p + 1]) - dcfg.symbol_start - 2 * a
        key[0, 0, p + 1, fact // a] = 1.0
    v = torch.eye(n)[None, None]
    index = VSIndex.dense(1, 1, n, 64)
    across, _ = reference_attention(q, key, v, index, softmax_scale=1.0)
    within, _ = reference_attention(q, key, v, index, softmax_scale=1.0, cu_seqlens=s.cu_seqlens)
    for j, row in enumerate(rows.tolist()):
        own = int(s.needle_positions[j])
        distractors = s.distractor_positions[j].tolist()
        assert len(distractors) == j  # every earlier document holds one
        if distractors:
            # j same-key needles of earlier documents against one of its own: most of the row's attention
            assert float(across[0, 0, row, distractors].sum()) == pytest.approx(j / (j + 1), abs=1e-3)
        assert within[0, 0, row, distractors].sum() == 0
        assert within[0, 0, row, own] > 0.99
    assert s.query_documents.tolist() == list(range(k)) and (s.tokens == BOS).sum() == k


def test_packed_label_masks_and_loss():
    args = quality.parse_args(["--run", "dense", *TOY])
    cfg = quality.packed_config(args, 512)
    samples = [make_packed_sequence(cfg, i, layout_index=0) for i in (1, 2)]
    tokens = torch.stack([x.tokens for x in samples])
    answers, loss_mask = quality.packed_label_masks(tokens, args.value_len)
    assert answers.shape == loss_mask.shape == (2, 512)
    for row, x in enumerate(samples):
        # Column p predicts tokens[p + 1]: the answers shifted by one; the boundary columns predict a BOS.
        assert torch.nonzero(answers[row]).flatten().tolist() == (x.target_positions - 1).tolist()
        assert torch.nonzero(~loss_mask[row]).flatten().tolist() == (x.cu_seqlens[1:-1] - 1).tolist()
    per_token = torch.rand(2, 512)
    w = loss_mask.float() * (1 + 19 * answers.float())
    torch.testing.assert_close(quality.masked_training_loss(per_token, answers, 20.0, loss_mask),
                               (per_token * w).sum() / w.sum())
    torch.testing.assert_close(quality.masked_training_loss(per_token, answers, 1.0, loss_mask),
                               per_token[loss_mask].mean())


def test_document_density_counts_document_pairs():
    from megatron_mtraining import VSIndex
    from megatron_mtraining.kernels.reference import vs_mask

    n, cu = 512, torch.tensor([0, 100, 230, 512], dtype=torch.int32)
    assert quality.document_density(VSIndex.dense(2, 2, n, 64), cu, n) == pytest.approx(1.0)
    index = VSIndex.from_lists([[[0, 2], [0]]], [[[5, 130, 300], [7]]], block_size=64)
    pos = torch.arange(n)
    active = vs_mask(index, pos, pos, n // 64, cu).float().sum((-1, -2))  # [b, h] pairs within documents
    lengths = (cu[1:] - cu[:-1]).double()
    expected = float(active.mean()) / float((lengths * (lengths + 1) / 2).sum())
    assert quality.document_density(index, cu, n) == pytest.approx(expected)
    assert expected < 0.5


def test_document_density_counts_block_index_pairs():
    """document_density of a BlockIndex: its block mask expanded to tokens, causal and within
    documents (a block straddles documents), against the document-causal pairs."""
    from megatron_mtraining import BlockIndex

    n, bs = 512, 64
    cu = torch.tensor([0, 100, 230, 512], dtype=torch.int32)
    assert quality.document_density(BlockIndex.dense(2, 2, n, bs), cu, n) == pytest.approx(1.0)
    index = BlockIndex.random(3, 2, n, bs, density=0.4, generator=torch.Generator().manual_seed(5))
    doc = torch.searchsorted(cu.long(), torch.arange(n), right=True) - 1
    tokens = index.to_mask().repeat_interleave(bs, -2).repeat_interleave(bs, -1)
    active = tokens & torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
    lengths = (cu[1:] - cu[:-1]).double()
    per_row = active[:2].double().sum((-1, -2)) / float((lengths * (lengths + 1) / 2).sum())
    assert quality.document_density(index, cu, n) == pytest.approx(float(per_row.mean()))  # first 2 rows
    assert quality.document_density(index, cu, n, rows=3) == pytest.approx(
        float(active.double().sum((-1, -2)).mean()) / float((lengths * (lengths + 1) / 2).sum()))
    assert 0.2 < float(per_row.mean()) < 0.9
    # One document: the density of causal pairs.
    whole = torch.tensor([0, n], dtype=torch.int32)
    assert quality.document_density(index, whole, n, rows=3) == pytest.approx(float(index.density(n).mean()))


def test_packed_moba_run_and_merge(tmp_path):
    """--run moba --packed: every layer gets its iteration's documents, the MoBA index keeps a share
    of the document-causal pairs, and the merge with the packed dense run (no MTraining run, so an
    explicit --out) writes the packed keys for both runs."""
    flags = ["--moba-block-size", "64", "--moba-top-k", "2"]
    dense, moba, merged = (str(tmp_path / name) for name in ("d.json", "moba.json", "merged.json"))
    run("--run", "dense", "--out", dense, *TOY)
    spy = str(tmp_path / "spy.json")
    run("--run", "moba", "--out", moba, *TOY, *flags, spy_out=spy)
    with open(spy) as f:
        seen = json.load(f)
    args = quality.parse_args(["--run", "moba", *TOY, *flags])
    expected = []
    for phase, (seq_len, iters) in enumerate(quality.phases(args.phases)):
        cfg = quality.packed_config(args, seq_len)
        for it in range(iters):
            cu = input_cu_seqlens(cfg, phase * 1_000_000 + it, seq_len)
            expected += [[layer, seq_len, max(1, args.tokens_per_iteration // seq_len), cu] for layer in (1, 2)]
    assert seen[:len(expected)] == expected
    with open(moba) as f:
        result = json.load(f)
    assert result["sparse_inference_index"] == "moba"
    densities = [x for r in result["density_log"] for x in r["density_per_layer"]]
    assert all(0.0 < x <= 1.0 for x in densities) and min(densities) < 0.9

    out = run("--merge", dense, moba, "--out", merged)
    assert "distractor_rate" in out and "MoBA" in out
    with open(merged) as f:
        s = json.load(f)["summary"]
    assert s["packed"] is True and s["runs"] == ["dense", "moba"]
    assert set(s["distractor_rate"]) == set(s["distractor_rate_without_document_mask"]) == {"dense", "moba"}
    for key in ("moba_distractor_rate", "moba_distractor_rate_sparse_inference", "moba_held_out_loss",
                "moba_mean_density", "dense_distractor_rate"):
        assert isinstance(s[key], float), key
    assert s["moba_mean_density"] < 1 and "mtraining_distractor_rate" not in s and "targets" not in s


@pytest.mark.parametrize("argv, message", [
    (["--run", "dense", "--packed", "--documents", "5:3"], "1 <= MIN <= MAX"),
    (["--run", "dense", "--packed", "--documents", "3"], "MIN:MAX"),
    (["--run", "dense", "--packed", "--vocab-size", "128"], "distinct value per document"),
    (["--run", "dense", "--packed", "--phases", "128:10"], "too short"),
    (["--run", "dense", "--packed", "--document-mix", "4,0"], "--document-mix: lengths must be positive"),
    (["--run", "dense", "--packed", "--document-mix", "long"], "expected prolong or comma-separated lengths"),
    (["--run", "dense", "--packed", "--document-mix", ",".join(["1"] * 30)],
     "--document-mix: the packed probes need a distinct value per document"),
    # XAttention's builder refuses packed documents: said at parsing, not deep inside the training.
    (["--run", "xattn", "--packed"], "--run xattn --packed: XAttention's index builder (block_approx.xattn_index) "
                                     "does not score packed documents"),
])
def test_bad_packed_command_lines_fail_with_a_message(argv, message):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "quality.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_document_mix_reaches_the_corpus():
    """--document-mix prolong: every phase's sequences are the issue's mix scaled (the 32K phase
    holds all ten documents), and the merge records it."""
    args = quality.parse_args(["--run", "dense", "--packed", "--document-mix", "prolong"])
    assert quality.packed_config(args, 32768).document_mix == PROLONG_MIX
    assert len(packed_document_lengths(quality.packed_config(args, 32768), 0)) == 10
    assert quality.packed_config(quality.parse_args(["--run", "dense", "--packed"]), 32768).document_mix == ()
    assert quality.packed_summary({"settings": vars(args)}, {"settings": vars(args)})["document_mix"] == "prolong"
    script = open(os.path.join(REPO, "scripts", "gpu_quality.sh")).read()
    assert 'FLAGS="$FLAGS --document-mix $DOCUMENT_MIX"' in script


def test_packed_recipe_of_the_gpu_script():
    """PACKED=1 in scripts/gpu_quality.sh: the packed defaults (plus its time guard); every phase's
    and evaluation length's packed corpus generates quickly, with a value per probe document."""
    import time

    script = open(os.path.join(REPO, "scripts", "gpu_quality.sh")).read()
    flags = [m for m in re.findall(r"FLAGS=\$\{QUALITY_FLAGS:-(.*)\}", script) if "--packed" in m]
    assert len(flags) == 1
    from_script = quality.parse_args(["--run", "dense"] + flags[0].split())
    defaults = quality.parse_args(["--run", "dense", "--packed"])
    assert {k: v for k, v in vars(from_script).items() if k != "max_train_seconds"} == \
        {k: v for k, v in vars(defaults).items() if k != "max_train_seconds"}
    assert defaults.phases == quality.PACKED_PHASES and quality.parse_args(["--run", "dense"]).phases == quality.PHASES
    lengths = [s for s, _ in quality.phases(defaults.phases)] + [int(x) for x in defaults.eval_lengths.split(",")]
    start = time.time()
    for seq_len in lengths:
        cfg = quality.packed_config(defaults, seq_len)
        assert cfg.max_documents <= cfg.num_values
        assert make_packed_sequence(cfg, 0).tokens.numel() == seq_len + 1
        make_packed_probe(cfg, 0, 0.5)
    assert time.time() - start < 30
    assert "PREFIX=quality_packed" in script and 'merge mtraining "$PREFIX.json"' in script
