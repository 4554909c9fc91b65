"""A small megatron-core GPT whose core attention is MTrainingAttention, built the way the demo
(``examples/demo/demo.py``) and the quality benchmark (``benchmarks/quality.py``) train it."""

from __future__ import annotations

from ..config import MTrainingConfig

__all__ = ["build_small_gpt"]


def build_small_gpt(cfg: MTrainingConfig, *, num_layers: int, hidden_size: int, num_attention_heads: int,
                    num_query_groups: int, vocab_size: int, seq_length: int, context_parallel_size: int = 1,
                    dense_layers: int = 0, rotary_base: int = 10000):
    """A megatron-core GPTModel (local spec, RoPE, GQA, fp32 parameters on the CPU)
    whose core attention is MTrainingAttention with ``cfg`` (``cfg.index == "dense"``: exact
    causal attention through the same code path)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..integration.spec import get_gpt_layer_spec

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups, context_parallel_size=context_parallel_size,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0)  # fp32: no optimizer wrapper needed
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_spec(cfg, dense_layers=dense_layers),
                    vocab_size=vocab_size, max_sequence_length=seq_length, position_embedding_type="rope",
                    rotary_base=rotary_base)
