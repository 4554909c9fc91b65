"""The long-context evaluation (megatron_mtraining.evaluate) on the CPU.

MTraining attention inside a transformers model is checked against transformers' eager attention
on the tiny random models of ``tests/hf_models.py`` (dense index, and the vs index where it selects
every key: fp32, relative error < 1e-5, at a length that needs the padding to a block); a sparse
index must change the logits (the negative control). The needle scoring is exact match, checked on
fake models whose answers are known (an induction head that copies retrieves everything, a broken
one nothing, one wrong answer token fails a trial). Perplexity buckets are checked on a fake model
with a known loss at every position. The CLI runs end to end from a Hugging Face folder and from a
Megatron checkpoint, and refuses bad input with exit 2 and one error line.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import types
import zlib

import pytest
import torch

pytest.importorskip("transformers", reason="the evaluation loads its models with transformers (pip install .[hf])")

import hf_models  # noqa: E402
from hf_models import TOKENS, VOCAB, build_model, logits, rel_err, save_model  # noqa: E402

from megatron_mtraining.evaluate import (EvaluationError, build_sample, bucket_edges, enable_mtraining_attention,  # noqa: E402
                                         index_densities, load_documents, mtraining_attention_config,
                                         mtraining_attention_forward, parse_depths, parse_length, parse_lengths,
                                         run_needle, run_perplexity, score_sample, score_tokens, text_pieces,
                                         token_pieces, write_heatmap, write_png)
from megatron_mtraining.evaluate import scoring  # noqa: E402
from megatron_mtraining.evaluate.__main__ import main  # noqa: E402
from megatron_mtraining.evaluate.needle import FILLER, HEADER, NEEDLE, QUESTION  # noqa: E402

try:
    import matplotlib  # noqa: F401
    MATPLOTLIB = True
except ImportError:
    MATPLOTLIB = False

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
HIGH = 10.0  # the fake models' logit of the token they predict (0 elsewhere)


def tokens(length, seed=0):
    return torch.randint(0, TOKENS, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- attention


def eager_and_mtraining(name, config, ids):
    model = build_model(name)
    model.set_attn_implementation("eager")
    reference = logits(model, ids)
    enable_mtraining_attention(model, config)
    return reference, logits(model, ids), index_densities(model), model


@pytest.mark.parametrize("name", ["qwen2-tied", "llama3.1"])
def test_dense_index_gives_eager_logits_at_a_length_that_is_padded(name):
    reference, ours, densities, _ = eager_and_mtraining(name, mtraining_attention_config(index="dense"), tokens(100))
    assert len(densities) == 2 and all(d == 1.0 for d in densities)  # both layers ran MTraining's attention
    assert rel_err(ours, reference) < TOL


@pytest.mark.parametrize("name", ["qwen2-tied", "llama3.1"])
def test_vs_index_that_selects_everything_gives_eager_logits(name):
    reference, ours, densities, _ = eager_and_mtraining(name, mtraining_attention_config(top_p=1.0), tokens(128))
    assert len(densities) == 2 and all(d == 1.0 for d in densities)
    assert rel_err(ours, reference) < TOL


@pytest.mark.parametrize("name", ["qwen2-tied", "llama3.1"])
def test_a_sparse_index_changes_the_logits_and_keeps_them_finite(name):
    config = mtraining_attention_config(top_p=0.3, min_vertical=0)
    reference, ours, densities, _ = eager_and_mtraining(name, config, tokens(512))
    assert len(densities) == 2 and max(densities) < 0.8
    assert torch.isfinite(ours).all()
    assert rel_err(ours, reference) > 1e-2


def test_dense_layers_get_the_dense_index():
    model = build_model("qwen2-tied")
    enable_mtraining_attention(model, mtraining_attention_config(top_p=0.3, min_vertical=0), dense_layers=1)
    logits(model, tokens(512))
    first, second = index_densities(model)
    assert first == 1.0 and second < 0.8


def test_decode_steps_over_a_kv_cache_run_dense_attention():
    ids = tokens(80, seed=1)
    reference, _, _, model = eager_and_mtraining("qwen2-tied", mtraining_attention_config(index="dense"), ids)
    with torch.no_grad():
        out = model(ids[:, :70], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for start, end in ((70, 71), (71, 73), (73, 80)):  # one token, then chunks (q shorter than the cache)
            out = model(ids[:, start:end], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert rel_err(torch.cat(steps, 1).float(), reference) < TOL
    assert len(index_densities(model)) == 2  # the prefill's two layers; the decode steps build no index


def test_a_padding_mask_is_refused_and_a_full_mask_is_not():
    ids = tokens(100)
    reference, _, _, model = eager_and_mtraining("qwen2-tied", mtraining_attention_config(index="dense"), ids)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert rel_err(model(ids, attention_mask=mask).logits.float(), reference) < TOL
        mask[0, :5] = 0
        with pytest.raises(EvaluationError, match="beyond the causal"):
            model(ids, attention_mask=mask)


def gqa_reference(q, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def test_the_attention_function_takes_the_layers_scaling_and_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 100, 16), torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    module = torch.nn.Module()
    module.mtraining_config = mtraining_attention_config(index="dense")
    out, weights = mtraining_attention_forward(module, q, k, v, None, scaling=0.7)
    assert weights is None and out.shape == (1, 100, 4, 16)
    assert rel_err(out, gqa_reference(q, k, v, 0.7)) < TOL
    assert rel_err(out, gqa_reference(q, k, v, 0.25)) > 1e-2  # the default 1/sqrt(16) would differ
    with pytest.raises(EvaluationError, match="sliding_window"):
        mtraining_attention_forward(module, q, k, v, None, scaling=0.7, sliding_window=32)


# ---------------------------------------------------------------------------- scoring


def test_score_tokens_gives_the_models_log_softmax(monkeypatch):
    monkeypatch.setattr(scoring, "CHUNK", 7)  # several chunks of the output head
    model = build_model("qwen2-untied")
    ids = tokens(50)
    targets = torch.tensor([1, 5, 20, 21, 22, 30, 31, 40, 49])
    logprob, argmax = score_tokens(model, ids, targets)
    full = logits(model, ids)[0].log_softmax(-1)
    assert torch.allclose(logprob, full[targets - 1, ids[0, targets]], atol=1e-5)
    assert torch.equal(argmax, full[targets - 1].argmax(-1))


class FakeLM(torch.nn.Module):
    """``predict(ids)`` -> one next token per position; logits HIGH there, 0 elsewhere (no
    transformers decoder: scored from ``.logits``)."""

    def __init__(self, predict, vocab=VOCAB, strength=lambda i: HIGH):
        super().__init__()
        self.predict, self.vocab, self.strength = predict, vocab, strength

    def forward(self, input_ids, **_):
        ids = input_ids[0].tolist()
        out = torch.zeros(1, len(ids), self.vocab)
        for i, token in enumerate(self.predict(ids)):
            out[0, i, token] = self.strength(i)
        return types.SimpleNamespace(logits=out)


def induction(offset=1):
    """Predicts the token ``offset`` after the latest earlier occurrence of the current token:
    offset 1 copies what followed (retrieves the needle), offset 2 is off by one."""
    def predict(ids):
        last, out = {}, []
        for i, t in enumerate(ids):
            j = last.get(t)
            out.append(ids[j + offset] if j is not None and j + offset < len(ids) else 0)
            last[t] = i
        return out
    return predict


VOCABULARY = list(range(TOKENS))


def test_token_needle_sits_at_the_requested_depth():
    for depth in (0.0, 0.1, 0.5, 0.75, 1.0):
        pieces = token_pieces(VOCABULARY, trial=2, seed=3)
        sample = build_sample(300, depth, pieces)
        body = 300 - pieces.fixed_length
        assert len(sample.ids) == 300 and sample.needle_start == math.ceil(depth * body - 0.5)  # ties: earlier
        assert sample.ids[sample.needle_start:sample.needle_start + sample.needle_length] == pieces.needle
        assert sample.ids[sample.answer_start:] == pieces.answer == sample.answer
        assert sample.ids[sample.answer_start - len(pieces.question):sample.answer_start] == pieces.question
        filler = sample.ids[:sample.needle_start] + sample.ids[sample.needle_start + sample.needle_length:
                                                               sample.answer_start - len(pieces.question)]
        assert len(filler) == body and not set(filler) & set(pieces.needle)
    other = token_pieces(VOCABULARY, trial=3, seed=3)
    assert other.question == pieces.question and other.answer != pieces.answer  # one marker, a passkey per trial
    assert len(set(pieces.answer)) == len(pieces.answer)


def word_tokenizer():
    """A small BPE tokenizer trained on the needle's words (the test models' tokenizer has none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator([FILLER, HEADER, NEEDLE.format(passkey="0123456789"), QUESTION],
                             trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")


def test_text_needle_is_the_passkey_prompt_at_a_paragraph_boundary():
    tokenizer = word_tokenizer()
    pieces = text_pieces(tokenizer, trial=0)
    assert len(pieces.passkey) == 5 and pieces.passkey.isdigit()
    assert tokenizer.decode(pieces.answer).replace(" ", "") == pieces.passkey
    for depth in (0.0, 0.5, 1.0):
        sample = build_sample(400, depth, pieces)
        body = 400 - pieces.fixed_length
        offset = sample.needle_start - len(pieces.header)
        assert offset % pieces.unit == 0 or offset == body
        assert abs(offset - depth * body) <= pieces.unit / 2
        needle = tokenizer.decode(sample.ids[sample.needle_start:sample.needle_start + sample.needle_length])
        assert needle.replace(" ", "") == NEEDLE.format(passkey=pieces.passkey).replace(" ", "")
        assert tokenizer.decode(sample.ids).replace(" ", "").endswith(
            (QUESTION + pieces.passkey).replace(" ", ""))
    with pytest.raises(EvaluationError, match="too short"):
        build_sample(pieces.fixed_length - 1, 0.5, pieces)
    with pytest.raises(EvaluationError, match="--needle-mode tokens"):
        text_pieces(hf_tokenizer(), trial=0)


def hf_tokenizer():
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_models.save_tokenizer(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def logprob_of(correct: bool, vocab=VOCAB):
    return (HIGH if correct else 0.0) - math.log(math.exp(HIGH) + vocab - 1)


def test_needle_scoring_is_exact_match():
    pieces = lambda trial: token_pieces(VOCABULARY, trial)  # noqa: E731
    found = run_needle(FakeLM(induction(1)), pieces, [64, 200], [0.0, 0.5, 1.0], trials=3, log=lambda *a: None)
    assert found["accuracy"] == 1.0 and all(c["accuracy"] == 1.0 for c in found["cells"]) and len(found["cells"]) == 6
    assert found["mean_logprob"] == pytest.approx(logprob_of(True), abs=1e-5)
    missed = run_needle(FakeLM(induction(2)), pieces, [64, 200], [0.0, 0.5, 1.0], trials=3, log=lambda *a: None)
    assert missed["accuracy"] == 0.0
    assert missed["mean_logprob"] == pytest.approx(logprob_of(False), abs=1e-5)

    sample = build_sample(100, 0.5, pieces(0))
    last = sample.answer_start + len(sample.answer) - 2  # the position that predicts the last answer token
    oracle = lambda ids: ids[1:] + [0]  # noqa: E731
    one_wrong = lambda ids: [0 if i == last else t for i, t in enumerate(oracle(ids))]  # noqa: E731
    right = score_sample(FakeLM(oracle), sample)
    assert right["retrieved"] and right["predicted"] == sample.answer
    wrong = score_sample(FakeLM(one_wrong), sample)
    assert not wrong["retrieved"] and wrong["predicted"][:-1] == sample.answer[:-1]
    m = len(sample.answer)
    assert wrong["logprob"] == pytest.approx(((m - 1) * logprob_of(True) + logprob_of(False)) / m, abs=1e-5)


# ---------------------------------------------------------------------------- perplexity


def test_perplexity_buckets_average_the_loss_at_each_position():
    length, buckets = 33, 4
    assert bucket_edges(length, buckets) == [1, 9, 17, 25, 33]
    strength = lambda i: 0.25 * i  # noqa: E731  the logit of the right token, rising with the position
    model = FakeLM(lambda ids: ids[1:] + [0], strength=strength)
    docs = torch.randint(0, TOKENS, (3, length), generator=torch.Generator().manual_seed(0))
    found = run_perplexity(model, docs, buckets, log=lambda *a: None)
    nll = lambda t: math.log(math.exp(strength(t - 1)) + VOCAB - 1) - strength(t - 1)  # noqa: E731  token t
    for bucket, (start, end) in zip(found["buckets"], [(1, 9), (9, 17), (17, 25), (25, 33)]):
        expected = sum(nll(t) for t in range(start, end)) / (end - start)
        assert (bucket["start"], bucket["end"], bucket["tokens"]) == (start, end, 3 * (end - start))
        assert bucket["mean_nll"] == pytest.approx(expected, rel=1e-5)
        assert bucket["ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert found["mean_nll"] == pytest.approx(sum(nll(t) for t in range(1, length)) / (length - 1), rel=1e-5)
    assert found["buckets"][0]["mean_nll"] > found["buckets"][-1]["mean_nll"]
    with pytest.raises(EvaluationError, match="--ppl-buckets"):
        bucket_edges(length, 40)


def test_documents_from_text_and_from_token_ids(tmp_path):
    import numpy

    tokenizer = hf_tokenizer()
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"w{i % TOKENS}" for i in range(250)))
    docs = load_documents(str(text), tokenizer, 64)
    assert docs.shape == (3, 64) and docs[1, 0].item() == 64 and docs[2, 63].item() == 191 % TOKENS
    ids = torch.arange(40).view(4, 10)
    torch.save(ids, tmp_path / "ids.pt")
    numpy.save(tmp_path / "ids.npy", ids.numpy())
    assert torch.equal(load_documents(str(tmp_path / "ids.pt")), ids)
    assert torch.equal(load_documents(str(tmp_path / "ids.npy"), length=6, max_documents=2), ids[:2, :6])
    with pytest.raises(EvaluationError, match="exceeds the 10 tokens"):
        load_documents(str(tmp_path / "ids.pt"), length=11)
    torch.save(ids.float(), tmp_path / "floats.pt")
    with pytest.raises(EvaluationError, match="integer tensor"):
        load_documents(str(tmp_path / "floats.pt"))
    with pytest.raises(EvaluationError, match="no tokenizer"):
        load_documents(str(text), None, 64)


# ---------------------------------------------------------------------------- parsing, heat map


def test_lengths_and_depths_parse():
    assert parse_lengths("1k,2K,4096,1.5k,1M") == [1024, 2048, 4096, 1536, 1024 ** 2]
    assert parse_depths("0,0.25,1") == [0.0, 0.25, 1.0]
    for bad in ("1q", "", "0.3", "-1k", "k"):
        with pytest.raises(EvaluationError, match="cannot read"):
            parse_length(bad)
    with pytest.raises(EvaluationError, match=r"outside \[0, 1\]"):
        parse_depths("0,1.5")


def read_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        size, = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + size]
        assert struct.unpack(">I", data[pos + 8 + size:pos + 12 + size])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + size
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    rows = [raw[r * (1 + 3 * width) + 1:(r + 1) * (1 + 3 * width)] for r in range(height)]
    return width, height, lambda x, y: tuple(rows[y][3 * x:3 * x + 3])


def test_heat_map_png_writer(tmp_path):
    path = str(tmp_path / "needle.png")
    accuracy = [[1.0, 0.0, 0.5], [0.0, 1.0, float("nan")]]  # 2 depths x 3 lengths
    assert write_heatmap(path, accuracy, [1024, 2048, 4096], [0.0, 1.0], use_matplotlib=False, cell=10) == "png"
    width, height, pixel = read_png(path)
    assert (width, height) == (30, 20)
    green, red = pixel(5, 5), pixel(15, 5)
    assert green[1] > green[0] and red[0] > red[1]  # accuracy 1 green, 0 red
    assert pixel(5, 15) == red and pixel(15, 15) == green and pixel(29, 19) == (160, 160, 160)
    write_png(str(tmp_path / "dot.png"), [[(1, 2, 3)]])
    assert read_png(str(tmp_path / "dot.png"))[2](0, 0) == (1, 2, 3)


# ---------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_model("qwen2-tied", str(tmp_path_factory.mktemp("evaluate") / "hf"))


NEEDLE_ARGS = ["--needle-lengths", "96,160", "--needle-depths", "0,0.5,1", "--needle-trials", "2",
               "--needle-mode", "tokens"]


def run_main(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_from_a_hugging_face_folder(tmp_path, capsys, hf_dir):
    docs = tmp_path / "docs.pt"
    torch.save(torch.randint(0, TOKENS, (2, 128), generator=torch.Generator().manual_seed(0)), docs)
    out = tmp_path / "out"
    code, stdout, _ = run_main(capsys, "--hf", hf_dir, "--out", out, "--attention", "mtraining", *NEEDLE_ARGS,
                               "--ppl-data", docs, "--ppl-buckets", "4")
    assert code == 0
    needle = json.loads((out / "needle.json").read_text())
    assert [(c["length"], c["depth"]) for c in needle["cells"]] == [(n, d) for n in (96, 160) for d in (0, 0.5, 1)]
    assert all(len(c["trials"]) == 2 and 0 <= c["accuracy"] <= 1 and c["mean_logprob"] < 0
               and c["index_density"] == 1.0 for c in needle["cells"])
    assert needle["settings"]["attention"] == "mtraining" and needle["settings"]["mtraining"]["top_p"] == 0.9
    if MATPLOTLIB:
        assert (out / "needle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the fallback writer: a block of 32 x 32 pixels per cell
        assert read_png(str(out / "needle.png"))[:2] == (2 * 32, 3 * 32)
    ppl = json.loads((out / "perplexity.json").read_text())
    assert [(b["start"], b["end"]) for b in ppl["buckets"]] == [(1, 33), (33, 65), (65, 96), (96, 128)]
    assert ppl["documents"] == 2 and all(b["ppl"] > 1 for b in ppl["buckets"])
    assert "needle accuracy" in stdout and "perplexity by position" in stdout

    # A .txt file, tokenized by --tokenizer (a tokenizer-only folder: in the model's folder transformers
    # reads the word-level tokenizer as Qwen2's); dense attention gives the same needle scores.
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"w{i % TOKENS}" for i in range(300)))
    code, _, err = run_main(capsys, "--hf", hf_dir, "--out", tmp_path / "dense", *NEEDLE_ARGS, "--ppl-data", text,
                            "--ppl-length", "100", "--tokenizer", hf_models.tokenizer_dir(str(tmp_path)))
    assert code == 0, err
    dense = json.loads((tmp_path / "dense" / "needle.json").read_text())
    assert [c["mean_logprob"] for c in dense["cells"]] == pytest.approx([c["mean_logprob"] for c in needle["cells"]],
                                                                       abs=1e-4)
    assert json.loads((tmp_path / "dense" / "perplexity.json").read_text())["documents"] == 3


def test_cli_from_a_megatron_checkpoint(tmp_path, capsys, hf_dir):
    from megatron_mtraining.convert import hf_to_megatron

    ckpt = tmp_path / "ckpt"
    hf_to_megatron(hf_dir, str(ckpt), dtype="float32", log=lambda *a: None)
    docs = tmp_path / "docs.npy"
    import numpy

    numpy.save(docs, numpy.random.default_rng(0).integers(0, TOKENS, (2, 64)))
    results = {}
    for source in (["--ckpt", ckpt], ["--hf", hf_dir]):
        out = tmp_path / source[0][2:]
        code, stdout, _ = run_main(capsys, *source, "--out", out, *NEEDLE_ARGS, "--ppl-data", docs)
        assert code == 0, stdout
        results[source[0]] = [json.loads((out / name).read_text()) for name in ("needle.json", "perplexity.json")]
        assert (out / "needle.png").is_file()
    (needle_ckpt, ppl_ckpt), (needle_hf, ppl_hf) = results["--ckpt"], results["--hf"]
    assert needle_ckpt["settings"]["model"].startswith("--ckpt")
    assert [c["mean_logprob"] for c in needle_ckpt["cells"]] == pytest.approx(
        [c["mean_logprob"] for c in needle_hf["cells"]], abs=1e-4)
    assert ppl_ckpt["mean_nll"] == pytest.approx(ppl_hf["mean_nll"], abs=1e-4)


@pytest.mark.parametrize("argv, message", [
    (["--needle-lengths", "1q"], "cannot read '1q' as a length"),
    (["--needle-depths", "0,1.5"], r"outside \[0, 1\]"),
    (["--needle-lengths", "1k"], "exceeds the model's max_position_embeddings 256"),
    (["--needle-mode", "text"], "cannot spell the needle text"),
    (["--ppl-data", "missing.pt"], "no such file"),
    (["--needle-lengths", "8"], "needle length 8 is too short"),
    (["--no-needle"], "nothing to evaluate"),
])
def test_cli_refuses_bad_input(tmp_path, capsys, hf_dir, argv, message):
    args = ["--hf", hf_dir, "--out", tmp_path / "out", "--needle-mode", "tokens", "--needle-lengths", "96", *argv]
    code, _, err = run_main(capsys, *args)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert re.search(message, errors[0]), errors[0]
    assert not (tmp_path / "out" / "needle.json").exists()


def test_cli_refuses_a_missing_folder_and_a_missing_tokenizer(tmp_path, capsys):
    code, _, err = run_main(capsys, "--hf", tmp_path / "nothing", "--out", tmp_path / "out")
    assert code == 2 and "no Hugging Face model there" in err
    bare = save_model("qwen2-tied", str(tmp_path / "bare"), tokenizer=False)
    code, _, err = run_main(capsys, "--hf", bare, "--out", tmp_path / "out", "--needle-lengths", "96")
    assert code == 2 and "no tokenizer in" in err and "--needle-mode tokens" in err
    code, _, _ = run_main(capsys, "--hf", bare, "--out", tmp_path / "out", "--needle-lengths", "96",
                          "--needle-depths", "0.5", "--needle-trials", "1", "--needle-mode", "tokens")
    assert code == 0  # token needles need no tokenizer


def test_python_dash_m_exits_2_with_one_error_line(tmp_path, hf_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "megatron_mtraining.evaluate", "--hf", hf_dir, "--out",
                           str(tmp_path / "out"), "--needle-lengths", "2x"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: cannot read '2x' as a length in tokens: write an integer "
                                                "with an optional k (x1024) or M (x1024^2) suffix, e.g. 4k, 32k, 1M"]
