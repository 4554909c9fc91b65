"""benchmarks/packed.py on the CPU: the exact pair count behind its FLOP figures, and its smoke run."""

import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from common import cu_seqlens_of, document_mix, fixed_packed_index, packed_active_pairs  # noqa: E402

from megatron_mtraining import VSIndex  # noqa: E402
from megatron_mtraining.kernels.reference import vs_mask  # noqa: E402


def test_packed_active_pairs_equals_the_mask_count():
    n, B = 512, 16
    index = VSIndex.random(2, 3, n, B, max_slash=7, max_vertical=40, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 1, 50, 64, 200, 201, 333, n], dtype=torch.int32)
    pos = torch.arange(n)
    want = vs_mask(index, pos, pos, n // B, cu).sum((-1, -2)).double()
    assert torch.equal(packed_active_pairs(index, cu, n), want)


def test_document_mix_and_fixed_packed_index():
    lengths = document_mix(131072)
    assert lengths == [49152, 32768, 16384, 12288, 8192, 4096, 4096, 2048, 1024, 1024]
    assert sum(document_mix(524288)) == 524288 and document_mix(524288)[0] == 4 * 49152
    n = 4096
    cu = cu_seqlens_of(document_mix(n))
    index, pairs, doc_pairs = fixed_packed_index(1, 2, n, cu, 64, 0.2)
    assert abs(float(pairs.mean()) / doc_pairs - 0.2) < 0.05


def test_smoke_run(tmp_path):
    out = tmp_path / "packed.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "packed.py"), "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert run["packed"]["fwdbwd_ms"] > 0 and run["unpacked"]["fwdbwd_ms"] > 0
    assert result["check"]["ours"]["pass"]


def test_ring_balance_counts_pairs_within_documents():
    """ring_balance's per-block-pair counts with documents == the mask's, summed per block pair."""
    from ring_balance import block_pairs
    n, B = 256, 16
    index = VSIndex.random(1, 3, n, B, max_slash=6, max_vertical=30, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 3, 40, 64, 65, 180, n], dtype=torch.int32)
    pos = torch.arange(n)
    mask = vs_mask(index, pos, pos, n // B, cu)[0].sum(0).double()  # [n, n] over heads
    want = mask.view(n // B, B, n // B, B).sum((1, 3))
    assert torch.equal(block_pairs(index, n, cu), want)
