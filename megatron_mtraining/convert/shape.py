"""The model a conversion carries: one description of a Qwen2 / Llama decoder, read from a Hugging
Face ``config.json`` or from a Megatron checkpoint's saved arguments, and written back as either.

The same ``ModelShape`` gives Megatron's model flags (``megatron_flags``), the megatron-core
``TransformerConfig`` / ``GPTModel`` arguments (``megatron_io.build_gpt``) and the exported
``config.json`` (``hf_config``), so the three cannot disagree.

RoPE. Megatron's GPT exposes three position encodings that these families use: plain RoPE
(``--position-embedding-type rope``), YaRN (``--position-embedding-type yarn``) and Llama-3.1's
frequency scaling (``--use-rope-scaling``, with low/high frequency factors 1 and 4 and an original
context of 8192 fixed). YaRN's attention factor (cos and sin multiplied by it) is Hugging Face's
``attention_factor``, by default ``0.1 ln(factor) + 1``; Megatron computes it from ``--mscale`` and
``--mscale-all-dim`` (defaults 1 and 0: the same default), so any factor converts exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

__all__ = ["ConversionError", "FAMILIES", "Llama3RopeScaling", "ModelShape", "YarnRopeScaling", "hf_dtype", "padded_vocab_size"]

# model_type in config.json -> the architecture class written on export.
FAMILIES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# Megatron-LM core_r0.19's Llama-3.1 scaling constants (megatron.core RotaryEmbedding._apply_scaling).
MEGATRON_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


class ConversionError(ValueError):
    """The input cannot be converted; the message names what is wrong and what to do."""


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # The attention factor, Megatron's way: (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1).
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def attention_factor(self) -> float:
        return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelShape:
    family: str                      # "qwen2" | "llama"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int                  # rows of Hugging Face's embedding
    norm_epsilon: float
    qkv_bias: bool
    tied_embeddings: bool
    rope_base: float
    max_position_embeddings: int
    rope_scaling: Optional[Any] = None   # YarnRopeScaling | Llama3RopeScaling | None
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConversionError(f"unsupported architecture {self.family!r}: the converter handles "
                                  f"{', '.join(sorted(FAMILIES))} (Qwen2 / Qwen2.5 and Llama 3.x)")
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(f"{self.num_attention_heads} attention heads are not a multiple of "
                                  f"{self.num_query_groups} key/value heads")

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Dict[str, Any]) -> "ModelShape":
        """From a parsed ``config.json`` (transformers 4.x ``rope_theta`` / ``rope_scaling`` or
        5.x ``rope_parameters``)."""
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            archs = config.get("architectures") or []
            raise ConversionError(f"unsupported architecture: model_type {model_type!r} {archs}; the converter "
                                  "handles model_type 'qwen2' (Qwen2, Qwen2.5) and 'llama' (Llama 3.x)")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in config:
                raise ConversionError(f"config.json has no {key!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act {config['hidden_act']!r}: only SwiGLU (silu) MLPs are supported")
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise ConversionError("use_sliding_window is true: Megatron's GPT has no sliding-window layers")
        if model_type == "llama" and (config.get("mlp_bias") or config.get("attention_bias")):
            raise ConversionError("Llama with mlp_bias / attention_bias is not supported")
        heads = int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or {})
        legacy = config.get("rope_scaling") or {}
        rope.update({k: v for k, v in legacy.items() if k not in rope})
        base = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        return cls(
            family=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            ffn_hidden_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            kv_channels=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=int(config["vocab_size"]),
            norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2",
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_base=base,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rope_scaling=_rope_scaling_from_hf(rope),
            dtype=hf_dtype(config),
        )

    def hf_config(self, base: Optional[Dict[str, Any]] = None, max_position_embeddings: Optional[int] = None
                  ) -> Dict[str, Any]:
        """``config.json`` for this shape; ``base`` (the source model's config) keeps its other
        fields (token ids, initializer range, ...)."""
        config = {k: v for k, v in (base or {}).items()
                  if k not in ("rope_scaling", "rope_parameters", "rope_theta", "transformers_version")}
        config.update(
            architectures=[FAMILIES[self.family]], model_type=self.family,
            hidden_size=self.hidden_size, intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups, head_dim=self.kv_channels, vocab_size=self.vocab_size,
            rms_norm_eps=self.norm_epsilon, tie_word_embeddings=self.tied_embeddings, hidden_act="silu",
            max_position_embeddings=int(max_position_embeddings or self.max_position_embeddings),
            rope_theta=self.rope_base, torch_dtype=self.dtype, dtype=self.dtype)  # 4.x and 5.x names
        if self.family == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        scaling = self.rope_scaling
        if isinstance(scaling, YarnRopeScaling):
            config["rope_scaling"] = dict(rope_type="yarn", factor=scaling.factor,
                                          original_max_position_embeddings=scaling.original_max_position_embeddings,
                                          beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow)
            if (scaling.mscale, scaling.mscale_all_dim) != (1.0, 0.0):  # else Hugging Face's default factor
                config["rope_scaling"]["attention_factor"] = scaling.attention_factor
        elif isinstance(scaling, Llama3RopeScaling):
            config["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(scaling))
        else:
            config["rope_scaling"] = None
        return config

    # -- Megatron -----------------------------------------------------------------------------
    def megatron_flags(self, padded_vocab: Optional[int] = None) -> List[str]:
        """The model flags of ``pretrain_gpt.py`` for this shape (the run adds its own length,
        parallelism and data flags)."""
        flags = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                 "--ffn-hidden-size", str(self.ffn_hidden_size),
                 "--num-attention-heads", str(self.num_attention_heads)]
        if self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        flags += ["--kv-channels", str(self.kv_channels), "--normalization", "RMSNorm",
                  "--norm-epsilon", repr(self.norm_epsilon), "--swiglu", "--disable-bias-linear"]
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if not self.tied_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        flags += ["--rotary-base", _number(self.rope_base)]
        scaling = self.rope_scaling
        if isinstance(scaling, YarnRopeScaling):
            flags += ["--position-embedding-type", "yarn", "--rotary-scaling-factor", _number(scaling.factor),
                      "--yarn-original-max-position-embeddings", str(scaling.original_max_position_embeddings)]
            if (scaling.beta_fast, scaling.beta_slow) != (32.0, 1.0):
                flags += ["--yarn-beta-fast", _number(scaling.beta_fast), "--yarn-beta-slow", _number(scaling.beta_slow)]
            if (scaling.mscale, scaling.mscale_all_dim) != (1.0, 0.0):
                flags += ["--mscale", repr(scaling.mscale), "--mscale-all-dim", repr(scaling.mscale_all_dim)]
        else:
            flags += ["--position-embedding-type", "rope"]
            if isinstance(scaling, Llama3RopeScaling):
                flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(scaling.factor)]
        return flags

    @classmethod
    def from_megatron_args(cls, args: Any, *, family: str, vocab_size: int, dtype: str = "bfloat16"
                           ) -> "ModelShape":
        """From a Megatron checkpoint's saved argument namespace; ``family`` and the Hugging Face
        vocabulary size come from the model the run started from."""
        def get(name, default=None):
            return getattr(args, name, default)

        heads = int(get("num_attention_heads"))
        groups = int(get("num_query_groups") or heads) if get("group_query_attention") else heads
        if get("normalization", "RMSNorm") != "RMSNorm" or not get("swiglu", False):
            raise ConversionError("the checkpoint is not a Qwen2 / Llama decoder (RMSNorm and SwiGLU): "
                                  f"normalization {get('normalization')!r}, swiglu {get('swiglu')}")
        kind = get("position_embedding_type", "rope")
        scaling = None
        if kind == "yarn":
            scaling = YarnRopeScaling(factor=float(get("yarn_rotary_scaling_factor", get("rotary_scaling_factor"))),
                                      original_max_position_embeddings=int(get("yarn_original_max_position_embeddings")),
                                      beta_fast=float(get("yarn_beta_fast", 32.0) or 32.0),
                                      beta_slow=float(get("yarn_beta_slow", 1.0) or 1.0),
                                      mscale=float(_first(get("yarn_mscale"), get("mscale"), 1.0)),
                                      mscale_all_dim=float(_first(get("yarn_mscale_all_dim"), get("mscale_all_dim"), 0.0)))
        elif kind != "rope":
            raise ConversionError(f"position embedding {kind!r}: only rope and yarn are exported")
        elif get("use_rope_scaling", False):
            scaling = Llama3RopeScaling(factor=float(get("rope_scaling_factor", 8.0)), **MEGATRON_LLAMA3_ROPE)
        return cls(
            family=family, num_layers=int(get("num_layers")), hidden_size=int(get("hidden_size")),
            ffn_hidden_size=int(get("ffn_hidden_size")), num_attention_heads=heads, num_query_groups=groups,
            kv_channels=int(get("kv_channels") or get("hidden_size") // heads), vocab_size=int(vocab_size),
            norm_epsilon=float(get("norm_epsilon", 1e-5)), qkv_bias=bool(get("add_qkv_bias", False)),
            tied_embeddings=not get("untie_embeddings_and_output_weights", False),
            rope_base=float(get("rotary_base", 10000)),
            max_position_embeddings=int(get("max_position_embeddings") or get("seq_length")),
            rope_scaling=scaling, dtype=dtype)

    def check_megatron_args(self, args: Any, padded_vocab: Optional[int] = None) -> List[str]:
        """Each way the run's parsed Megatron arguments disagree with this shape (empty: none)."""
        problems = []
        expected = dict(num_layers=self.num_layers, hidden_size=self.hidden_size,
                        ffn_hidden_size=self.ffn_hidden_size, num_attention_heads=self.num_attention_heads,
                        kv_channels=self.kv_channels, add_qkv_bias=self.qkv_bias,
                        untie_embeddings_and_output_weights=not self.tied_embeddings,
                        rotary_base=self.rope_base)
        for name, want in expected.items():
            have = getattr(args, name, None)
            if have is None and name == "kv_channels":
                have = args.hidden_size // args.num_attention_heads
            if isinstance(want, bool):
                have = bool(have)
            elif have is not None:
                have = type(want)(have)
            if have != want:
                problems.append(f"--{name.replace('_', '-')}: the run has {have}, the checkpoint {want}")
        groups = int(getattr(args, "num_query_groups", None) or args.num_attention_heads) \
            if getattr(args, "group_query_attention", False) else args.num_attention_heads
        if groups != self.num_query_groups:
            problems.append(f"--num-query-groups: the run has {groups}, the checkpoint {self.num_query_groups}")
        have_vocab = getattr(args, "padded_vocab_size", None)
        if padded_vocab is not None and have_vocab is not None and int(have_vocab) != int(padded_vocab):
            problems.append(f"padded vocabulary: the run pads its tokenizer to {have_vocab} rows, the checkpoint "
                            f"has {padded_vocab} (the tokenizer, --make-vocab-size-divisible-by and TP decide it)")
        return problems

    def check_tensor_parallel(self, tp: int) -> None:
        if tp < 1:
            raise ConversionError(f"--tp {tp}: must be at least 1")
        for what, count in (("attention heads", self.num_attention_heads),
                            ("key/value heads (query groups)", self.num_query_groups),
                            ("FFN width", self.ffn_hidden_size)):
            if count % tp:
                raise ConversionError(f"tensor parallelism {tp} does not divide the {count} {what}")

    def to_json(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        scaling = self.rope_scaling
        data["rope_scaling"] = None if scaling is None else {"kind": type(scaling).__name__, **dataclasses.asdict(scaling)}
        return data

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ModelShape":
        data = dict(data)
        scaling = data.pop("rope_scaling", None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = {"YarnRopeScaling": YarnRopeScaling, "Llama3RopeScaling": Llama3RopeScaling}[scaling.pop("kind")]
            scaling = kind(**scaling)
        return cls(rope_scaling=scaling, **data)


def hf_dtype(config: Dict[str, Any]) -> str:
    """The weights' dtype a config.json states (transformers 5 writes ``dtype``, 4.x ``torch_dtype``)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")


def padded_vocab_size(rows: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padding of a vocabulary of ``rows`` tokens (``vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return int(math.ceil(rows / multiple) * multiple)


def _rope_scaling_from_hf(rope: Dict[str, Any]):
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "yarn":
        factor = float(rope["factor"])
        attention = rope.get("attention_factor")
        mscale, mscale_all_dim = 1.0, 0.0  # Hugging Face's default factor
        if attention is not None:
            if factor <= 1 and float(attention) != 1.0:
                raise ConversionError(f"YaRN attention_factor {attention} with factor {factor} <= 1")
            mscale = 0.0 if factor <= 1 else (float(attention) - 1.0) / (0.1 * math.log(factor))
        elif rope.get("mscale") and rope.get("mscale_all_dim"):
            mscale, mscale_all_dim = float(rope["mscale"]), float(rope["mscale_all_dim"])
        if rope.get("truncate") is False:
            raise ConversionError("YaRN with truncate=false: Megatron rounds the correction range to integers")
        original = rope.get("original_max_position_embeddings")
        if original is None:
            raise ConversionError("YaRN rope scaling without original_max_position_embeddings")
        return YarnRopeScaling(factor=factor, original_max_position_embeddings=int(original),
                               beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                               mscale=mscale, mscale_all_dim=mscale_all_dim)
    if kind == "llama3":
        scaling = Llama3RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                    high_freq_factor=float(rope["high_freq_factor"]),
                                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        fixed = {k: getattr(scaling, k) for k in MEGATRON_LLAMA3_ROPE}
        if fixed != MEGATRON_LLAMA3_ROPE:
            raise ConversionError(f"Llama-3 rope scaling with {fixed}: Megatron's --use-rope-scaling fixes "
                                  f"{MEGATRON_LLAMA3_ROPE}")
        return scaling
    raise ConversionError(f"rope scaling {kind!r} is not supported (default, yarn and llama3 are)")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _first(*values):
    return next(v for v in values if v is not None)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
