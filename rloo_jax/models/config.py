"""Model configuration: one frozen, hashable dataclass read from a Hugging Face `config.json` dict.

Two families share one module tree (see `transformer.py`):
- "llama": Llama 2/3, Qwen2/2.5, Mistral. RMSNorm, SwiGLU MLP, full rotary, sequential residual.
- "gpt_neox": GPT-NeoX / Pythia. LayerNorm with bias, gelu MLP with bias, partial rotary, parallel residual
  (optional), fused QKV in the checkpoint (split into q/k/v on load, see `hf.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rloo_jax.models.attention import IMPLEMENTATIONS
from rloo_jax.quant import QuantSpec


class ModelLoadError(ValueError):
    """A checkpoint or config cannot be turned into one of our models (the message says why)."""


# HF architecture name -> (family, task). `task` is "causal_lm" or "reward".
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "Qwen2ForCausalLM": ("llama", "causal_lm"),
    "MistralForCausalLM": ("llama", "causal_lm"),
    "GPTNeoXForCausalLM": ("gpt_neox", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "Qwen2ForSequenceClassification": ("llama", "reward"),
    "MistralForSequenceClassification": ("llama", "reward"),
    "GPTNeoXForSequenceClassification": ("gpt_neox", "reward"),
}
MODEL_TYPES: dict[str, str] = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "gpt_neox": "gpt_neox"}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")
# What the backward pass keeps of each transformer block (MaxText's `remat_policy` names); the rest is recomputed.
# Named block outputs (`checkpoint_name` in transformer.py): query_proj, key_proj, value_proj, out_proj,
# mlpwi (gate and up), mlpwo (down), decoder_layer_input.
REMAT_POLICIES: dict[str, str] = {
    "none": "no rematerialisation: every intermediate of every block lives until the backward pass",
    "minimal": "keep every projection output (q, k, v, o, gate, up, down); recompute norms, RoPE, softmax, "
    "activations",
    "save_dot_except_mlp": "keep the attention projections (q, k, v, o); recompute the MLP",
    "save_qkv_proj": "keep q, k, v only",
    "full": "keep only each block's input; recompute the whole block in the backward pass",
    "full_offloaded": "as full, with the block inputs offloaded to host memory (TPU/GPU; not on CPU)",
}
# LoRA targets: Hugging Face module name -> our projection (`transformer.py`), per family. GPT-NeoX's fused
# `query_key_value` is our q, k and v sharing one A (its B split three ways, as the kernel is).
LORA_MODULES: dict[str, dict[str, str]] = {
    "llama": {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
              "down_proj": "down"},
    "gpt_neox": {"query_key_value": "qkv", "dense": "o", "dense_h_to_4h": "up", "dense_4h_to_h": "down"},
}
# peft's defaults when no target is named (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
LORA_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {"llama": ("q_proj", "v_proj"), "gpt_neox": ("query_key_value",)}


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """Low-rank adapters on some projections: y = x W + scale * dropout(x) A B, A [din, r], B [r, dout].

    `targets` are Hugging Face module names of the family (`LORA_MODULES`); scale = alpha / r, or alpha / sqrt(r)
    with `use_rslora` (peft's rsLoRA). Dropout applies to the adapter's input in training forwards only.
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def ours(self, family: str) -> frozenset[str]:
        """Our projection names the targets select ("q", "k", "v", "o", "gate", "up", "down"; "qkv" fused)."""
        return frozenset(LORA_MODULES[family][t] for t in self.targets)


def lora_spec(
    family: str, rank: int, alpha: float, dropout: float = 0.0, targets: Any = None, use_rslora: bool = False
) -> LoRASpec:
    """A validated `LoRASpec` for a family: `targets` None -> peft's defaults, "all-linear" -> every projection
    of the blocks (not the LM head, as peft), else HF module names (`LORA_MODULES`)."""
    names = LORA_MODULES[family]
    if targets is None:
        chosen = LORA_DEFAULT_TARGETS[family]
    elif targets in ("all-linear", ["all-linear"], ("all-linear",)):
        chosen = tuple(names)
    else:
        chosen = tuple(dict.fromkeys(str(t) for t in targets))
        unknown = [t for t in chosen if t not in names]
        if unknown or not chosen:
            raise ModelLoadError(
                f"lora_target_modules: {', '.join(unknown) or '(none)'} is not a projection of a {family} model; "
                f"choose from {', '.join(names)} or all-linear"
            )
    if rank < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise ModelLoadError(f"LoRA needs rank >= 1, alpha > 0, 0 <= dropout < 1 (got {rank}, {alpha}, {dropout})")
    return LoRASpec(int(rank), float(alpha), float(dropout), chosen, bool(use_rslora))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model description; hashable so a module's graphdef can be a jit static argument.

    `hf_config` (the original `config.json` dict) is kept for export and excluded from hashing/equality.
    """

    family: str  # "llama" | "gpt_neox"
    model_type: str  # HF model_type: "llama", "qwen2", "mistral", "gpt_neox"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    hidden_act: str  # "silu" (llama) | "gelu" | "gelu_new" | "gelu_pytorch_tanh" | "relu"
    rope_theta: float
    rotary_dim: int  # leading head dims that are rotated (= head_dim * partial_rotary_factor)
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    rope_factors: tuple[tuple[str, float], ...] = ()  # e.g. (("factor", 8.0), ("low_freq_factor", 1.0), ...)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = False
    sliding_window: int | None = None  # Mistral: a key is visible iff q_pos - k_pos < sliding_window
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # execution choices (never exported to config.json): how the L blocks run and what their backward keeps
    scan_layers: bool = True  # jax.lax.scan over the stacked blocks (False: unrolled; the same numbers)
    remat_policy: str = "none"  # a key of REMAT_POLICIES
    lora: LoRASpec | None = None  # low-rank adapters on some projections (None: the plain model)
    # the block projections' kernels stored quantized, dequantized in the forward (QLoRA's frozen base; None: plain)
    quant: QuantSpec | None = None
    # how the forwards compute attention (`attention.IMPLEMENTATIONS`: eager, splash, cudnn); None: the best for
    # the platform compiled for. Decoding keeps its one-query einsum whatever this says.
    attn_implementation: str | None = None
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ModelLoadError(f"{name}={getattr(self, name)!r}; supported: {', '.join(DTYPES)}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ModelLoadError(f"remat_policy={self.remat_policy!r}; supported: {', '.join(REMAT_POLICIES)}")
        if self.attn_implementation not in (None, *IMPLEMENTATIONS):
            raise ModelLoadError(f"attn_implementation={self.attn_implementation!r}; supported: "
                                 f"{', '.join(IMPLEMENTATIONS)} or None (the best for the platform)")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (e.g. `cfg.replace(dtype="bfloat16")`)."""
        return dataclasses.replace(self, **changes)


def rope_inv_freq(
    rotary_dim: int, theta: float, rope_type: str = "default", factors: tuple[tuple[str, float], ...] = ()
) -> np.ndarray:
    """Inverse rotary frequencies, as HF `modeling_rope_utils`, float32 [rotary_dim // 2].

    default: inv_freq_i = theta ** (-2i / rotary_dim).  linear: inv_freq / factor.
    llama3: wavelen = 2 pi / inv_freq; wavelen > old_len / low_ff -> inv_freq / factor; wavelen < old_len / high_ff
    -> unchanged; in between s = (old_len / wavelen - low_ff) / (high_ff - low_ff), (1 - s) inv / factor + s inv.
    Example: rope_inv_freq(4, 10000.0) -> [1.0, 0.01].
    """
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)))
    f = dict(factors)
    if rope_type == "linear":
        return (inv / np.float32(f["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor, low, high = f["factor"], f["low_freq_factor"], f["high_freq_factor"]
        old_len = f["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv.astype(np.float32)


def _require(hf: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if hf.get(k) is not None:
            return hf[k]
    raise ModelLoadError(f"config.json lacks {' / '.join(keys)}")


def family_and_task(hf: dict[str, Any]) -> tuple[str, str | None]:
    """(family, task) from `architectures[0]` (task None when only `model_type` is known)."""
    archs = hf.get("architectures") or []
    if archs:
        if archs[0] not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        return ARCHITECTURES[archs[0]]
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {mt!r}; supported: {', '.join(sorted(MODEL_TYPES))}")
    return MODEL_TYPES[mt], None


def _rope_settings(hf: dict[str, Any], head_dim: int, default_prf: float) -> dict[str, Any]:
    """Rotary settings from the new `rope_parameters` dict or the old top-level keys / `rope_scaling`."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rp.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    prf = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", default_prf)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    factors: tuple[tuple[str, float], ...] = ()
    if rope_type == "linear":
        factors = (("factor", float(rp["factor"])),)
    elif rope_type == "llama3":
        old_len = rp.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        factors = (
            ("factor", float(rp["factor"])),
            ("low_freq_factor", float(rp["low_freq_factor"])),
            ("high_freq_factor", float(rp["high_freq_factor"])),
            ("original_max_position_embeddings", float(old_len)),
        )
    return {
        "rope_theta": float(theta),
        "rotary_dim": int(head_dim * float(prf)),
        "rope_type": rope_type,
        "rope_factors": factors,
    }


def config_from_hf(hf: dict[str, Any], dtype: str = "float32", param_dtype: str | None = None) -> ModelConfig:
    """Build a `ModelConfig` from a HF `config.json` dict (old and new rope formats)."""
    family, _ = family_and_task(hf)
    model_type = hf.get("model_type") or {"gpt_neox": "gpt_neox"}.get(family, "llama")
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    common = dict(
        family=family,
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_require(hf, "num_hidden_layers")),
        num_heads=heads,
        head_dim=head_dim,
        intermediate_size=int(_require(hf, "intermediate_size")),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        dtype=dtype,
        param_dtype=param_dtype or dtype,
        hf_config=dict(hf),
    )
    if family == "gpt_neox":
        bias = bool(hf.get("attention_bias", True))
        return ModelConfig(
            **common,
            num_kv_heads=heads,
            norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
            hidden_act=hf.get("hidden_act", "gelu"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=True,
            parallel_residual=bool(hf.get("use_parallel_residual", True)),
            **_rope_settings(hf, head_dim, 0.25),
        )
    sliding = None
    if model_type == "mistral":
        sliding = hf.get("sliding_window")
    elif model_type == "qwen2" and hf.get("use_sliding_window"):
        raise ModelLoadError("Qwen2 with use_sliding_window=True is not supported")
    qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
    return ModelConfig(
        **common,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        hidden_act=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type == "qwen2")),
        qkv_bias=qkv_bias,
        o_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        parallel_residual=False,
        sliding_window=None if sliding is None else int(sliding),
        **_rope_settings(hf, head_dim, 1.0),
    )


def config_to_hf(cfg: ModelConfig, architecture: str) -> dict[str, Any]:
    """The HF `config.json` dict for export: the original dict with every field we use written explicitly.

    Rope settings are written in both the new (`rope_parameters`) and old (top-level) forms, with equal values.
    """
    hf = dict(cfg.hf_config)
    for k in ("rope_scaling", "rope_theta", "rotary_pct", "rotary_emb_base", "partial_rotary_factor"):
        hf.pop(k, None)
    prf = cfg.rotary_dim / cfg.head_dim
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, **dict(cfg.rope_factors)}
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    hf.update(
        architectures=[architecture],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_act=cfg.hidden_act,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        dtype="float32",
        rope_theta=cfg.rope_theta,
    )
    hf.pop("torch_dtype", None)
    if cfg.family == "gpt_neox":
        hf.update(
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_residual,
            attention_bias=cfg.qkv_bias,
            rotary_pct=prf,
            rotary_emb_base=cfg.rope_theta,
            rope_parameters={**rope, "partial_rotary_factor": prf},
        )
    else:
        hf.update(
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters=rope,
        )
        if cfg.rope_type != "default":
            hf["rope_scaling"] = dict(rope)
        if cfg.model_type != "qwen2":
            hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
        if cfg.model_type == "mistral":
            hf["sliding_window"] = cfg.sliding_window
    return hf
