"""Tensor by tensor, a Hugging Face Qwen2 / Llama state dict and a megatron-core GPT state dict.

megatron-core names (local layer spec, no tensor parallelism; the TE spec stores the same tensors,
its layer norms fused into the next linear layer, and megatron-core's checkpoints use the TE names
for both, see ``megatron_io``):

=========================================================  =========================================
megatron-core                                              Hugging Face
=========================================================  =========================================
``embedding.word_embeddings.weight``                       ``model.embed_tokens.weight`` (+ padding)
``decoder.layers.L.input_layernorm.weight``                ``model.layers.L.input_layernorm.weight``
``decoder.layers.L.self_attention.linear_qkv.weight/bias``  ``q_proj``, ``k_proj``, ``v_proj`` per group
``decoder.layers.L.self_attention.linear_proj.weight``     ``model.layers.L.self_attn.o_proj.weight``
``decoder.layers.L.pre_mlp_layernorm.weight``              ``model.layers.L.post_attention_layernorm.weight``
``decoder.layers.L.mlp.linear_fc1.weight``                 ``[gate_proj; up_proj]``
``decoder.layers.L.mlp.linear_fc2.weight``                 ``model.layers.L.mlp.down_proj.weight``
``decoder.final_layernorm.weight``                         ``model.norm.weight``
``output_layer.weight`` (untied only)                      ``lm_head.weight``
=========================================================  =========================================

The fused QKV projection is grouped by key/value head: for each group, its query heads, then its
key head, then its value head (``heads / groups + 2`` blocks of ``kv_channels`` rows). SwiGLU's
first projection is the gate then the up projection (megatron-core applies ``silu`` to the first
half). Both directions only cut and concatenate, so HF -> Megatron -> HF returns every tensor bit
for bit.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .shape import ConversionError, ModelShape

__all__ = ["hf_to_megatron_state", "megatron_to_hf_state", "vocab_tail"]

StateDict = Dict[str, torch.Tensor]


def hf_to_megatron_state(hf: StateDict, shape: ModelShape, padded_vocab: int) -> StateDict:
    """megatron-core's state dict (local spec names) from Hugging Face's tensors."""
    _check_hf_keys(hf, shape)
    out: StateDict = {"embedding.word_embeddings.weight": _resize_rows(hf["model.embed_tokens.weight"], padded_vocab)}
    for layer in range(shape.num_layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape)
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"],
                                                        hf[src + "mlp.up_proj.weight"]], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not shape.tied_embeddings:
        out["output_layer.weight"] = _resize_rows(hf["lm_head.weight"], padded_vocab)
    return out


def megatron_to_hf_state(mc: StateDict, shape: ModelShape, vocab_tail: Optional[StateDict] = None) -> StateDict:
    """Hugging Face's tensors from megatron-core's; the embedding is cut (or, with the rows
    ``hf_to_megatron`` dropped, ``vocab_tail``, restored) to ``shape.vocab_size`` rows."""
    vocab_tail = vocab_tail or {}
    out: StateDict = {"model.embed_tokens.weight": _restore_rows(
        mc["embedding.word_embeddings.weight"], shape.vocab_size, vocab_tail.get("model.embed_tokens.weight"))}
    group_rows = (shape.num_attention_heads // shape.num_query_groups + 2) * shape.kv_channels
    for layer in range(shape.num_layers):
        src, dst = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        attn = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = mc[src + "input_layernorm.weight"]
        qkv = mc[src + "self_attention.linear_qkv.weight"]
        if qkv.shape[0] != group_rows * shape.num_query_groups:
            raise ConversionError(f"layer {layer}: linear_qkv has {qkv.shape[0]} rows, the shape needs "
                                  f"{group_rows * shape.num_query_groups}")
        q, k, v = _split_qkv(qkv, shape)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if shape.qkv_bias:
            q, k, v = _split_qkv(mc[src + "self_attention.linear_qkv.bias"], shape)
            out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
        out[attn + "o_proj.weight"] = mc[src + "self_attention.linear_proj.weight"]
        out[dst + "post_attention_layernorm.weight"] = mc[src + "pre_mlp_layernorm.weight"]
        gate, up = mc[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[dst + "mlp.down_proj.weight"] = mc[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if not shape.tied_embeddings:
        out["lm_head.weight"] = _restore_rows(mc["output_layer.weight"], shape.vocab_size,
                                              vocab_tail.get("lm_head.weight"))
    return out


def vocab_tail(hf: StateDict, shape: ModelShape, padded_vocab: int) -> StateDict:
    """The embedding (and output) rows past ``padded_vocab`` that Megatron's smaller padding drops:
    kept beside the checkpoint so that the export restores them."""
    if padded_vocab >= shape.vocab_size:
        return {}
    keys = ["model.embed_tokens.weight"] + ([] if shape.tied_embeddings else ["lm_head.weight"])
    return {key: hf[key][padded_vocab:].clone() for key in keys}


def _check_hf_keys(hf: StateDict, shape: ModelShape) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                     "mlp.down_proj.weight")}
        if shape.qkv_bias:
            expected |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
    if not shape.tied_embeddings:
        expected.add("lm_head.weight")
    ignorable = {"lm_head.weight"} if shape.tied_embeddings else set()
    missing = sorted(expected - set(hf))
    extra = sorted(k for k in set(hf) - expected - ignorable if not k.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise ConversionError("the weights do not match config.json: "
                              + "; ".join(filter(None, [f"missing {_few(missing)}" if missing else "",
                                                        f"unexpected {_few(extra)}" if extra else ""])))
    if shape.tied_embeddings and "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"],
                                                                            hf["model.embed_tokens.weight"]):
        raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from the embedding")
    d, groups, heads = shape.kv_channels, shape.num_query_groups, shape.num_attention_heads
    for name, rows in (("q_proj", heads * d), ("k_proj", groups * d), ("v_proj", groups * d)):
        have = hf[f"model.layers.0.self_attn.{name}.weight"].shape
        if tuple(have) != (rows, shape.hidden_size):
            raise ConversionError(f"{name}.weight is {tuple(have)}, config.json implies {(rows, shape.hidden_size)}")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, d = shape.num_query_groups, shape.kv_channels
    per = shape.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * d, *rest)


def _split_qkv(qkv: torch.Tensor, shape: ModelShape):
    groups, d = shape.num_query_groups, shape.kv_channels
    per = shape.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return (q.reshape(groups * per * d, *rest).clone(), k.reshape(groups * d, *rest).clone(),
            v.reshape(groups * d, *rest).clone())


def _resize_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] >= rows:
        return weight[:rows]
    pad = weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def _restore_rows(weight: torch.Tensor, rows: int, tail: Optional[torch.Tensor]) -> torch.Tensor:
    if weight.shape[0] >= rows:
        return weight[:rows].clone()
    if tail is None or weight.shape[0] + tail.shape[0] != rows:
        raise ConversionError(f"the checkpoint has {weight.shape[0]} vocabulary rows, the Hugging Face model "
                              f"{rows}, and the rows the conversion dropped are not beside it")
    return torch.cat([weight, tail.to(weight.dtype)], dim=0)


def _few(keys, limit: int = 4) -> str:
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
