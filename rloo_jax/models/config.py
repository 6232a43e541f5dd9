"""Model configuration: one frozen, hashable dataclass read from a Hugging Face `config.json` dict.

Three families share one module tree (see `transformer.py`); what differs within a family is a few static flags:
- "llama": Llama 2/3/3.2/3.3, Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3 (text), OLMo 2, SmolLM3. RMSNorm, gated
  MLP, full rotary, sequential residual. Flags: q/k norms (`qk_norm`: per head for Qwen3 and Gemma 3, over the whole
  projection for OLMo 2), where the norms sit (`norm_layout`: pre, Gemma's pre+post "sandwich", OLMo 2's post),
  Gemma's (1 + w) norms, embedding scaling, attention scale, attention and final-logit soft-capping, per-layer
  sliding windows and RoPE (`layer_types`, `local_rope_theta`, SmolLM3's NoPE layers `rope_layers`).
- "phi3": Phi-3 / Phi-4. The llama block, with q/k/v and gate/up fused in the checkpoint (`qkv_proj`,
  `gate_up_proj`: split on load, `hf.py`), and LongRoPE (`su`) scaling.
- "gpt_neox": GPT-NeoX / Pythia. LayerNorm with bias, gelu MLP with bias, partial rotary, parallel residual
  (optional), fused QKV in the checkpoint (split into q/k/v on load, see `hf.py`).

A mixture of experts is a llama-family model whose MLPs are routed (`num_experts` > 0; per layer `moe_layers`):
Qwen3-MoE, each token to the top `num_experts_per_tok` of softmax(router logits) (renormalised with
`norm_topk_prob`), some layers dense (`decoder_sparse_step`, `mlp_only_layers`). The math: `moe.py`.
GPT-OSS is one too, every layer routed, with its own flags: attention sinks (`attention_sinks`), q/k/v/o biases,
alternating sliding / full layers, YaRN RoPE, a router bias and the softmax of the top-k logits (`router_bias`,
`router_topk_softmax`), expert biases and a clamped SwiGLU (`expert_bias`, `swiglu_limit`, `swiglu_alpha`); its
MXFP4 checkpoints are dequantized on load (`hf.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from rloo_jax.models.attention import IMPLEMENTATIONS
from rloo_jax.models.moe import IMPLEMENTATIONS as MOE_IMPLEMENTATIONS
from rloo_jax.quant import QuantSpec


class ModelLoadError(ValueError):
    """A checkpoint or config cannot be turned into one of our models (the message says why)."""


# HF model_type -> (family, class-name stem): `{stem}ForCausalLM` and `{stem}ForSequenceClassification`.
MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "Llama"),
    "qwen2": ("llama", "Qwen2"),
    "qwen3": ("llama", "Qwen3"),
    "mistral": ("llama", "Mistral"),
    "gemma2": ("llama", "Gemma2"),
    "gemma3_text": ("llama", "Gemma3"),
    "olmo2": ("llama", "Olmo2"),
    "smollm3": ("llama", "SmolLM3"),
    "phi3": ("phi3", "Phi3"),
    "gpt_neox": ("gpt_neox", "GPTNeoX"),
    "qwen3_moe": ("llama", "Qwen3Moe"),
    "gpt_oss": ("llama", "GptOss"),
}


def architecture_names(model_type: str) -> tuple[str, str]:
    """The HF class names of a model_type's causal LM and sequence classifier (reward model)."""
    stem = MODEL_TYPES[model_type][1]
    reward = "Gemma3TextForSequenceClassification" if model_type == "gemma3_text" else \
        f"{stem}ForSequenceClassification"
    return f"{stem}ForCausalLM", reward


# HF architecture name -> (family, task). `task` is "causal_lm" or "reward".
ARCHITECTURES: dict[str, tuple[str, str]] = {
    name: (family, task)
    for model_type, (family, _) in MODEL_TYPES.items()
    for name, task in zip(architecture_names(model_type), ("causal_lm", "reward"), strict=True)
}
# the model_type each architecture's config.json carries
ARCHITECTURE_MODEL_TYPES: dict[str, str] = {
    name: model_type for model_type in MODEL_TYPES for name in architecture_names(model_type)
}
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# rope types only some model types are read with (the ones tested against transformers): rope_type -> model types
ROPE_TYPES_OF = {"longrope": ("phi3",), "yarn": ("gpt_oss",)}
LAYER_TYPES = ("full_attention", "sliding_attention")
NORM_LAYOUTS = ("pre", "sandwich", "post")
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
# Phi-3's fused `qkv_proj` and `gate_up_proj` likewise: one A, B split into q/k/v and gate/up.
LORA_MODULES: dict[str, dict[str, str]] = {
    "llama": {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
              "down_proj": "down"},
    "phi3": {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"},
    "gpt_neox": {"query_key_value": "qkv", "dense": "o", "dense_h_to_4h": "up", "dense_4h_to_h": "down"},
}
# peft's defaults when no target is named (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: q_proj, v_proj
# for llama, qwen2, qwen3, mistral, gemma2, gemma3_text). peft has none for phi3, olmo2, smollm3 (it asks for
# target_modules); those get their family's: q_proj, v_proj, and Phi-3's fused qkv_proj.
LORA_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {"llama": ("q_proj", "v_proj"), "phi3": ("qkv_proj",),
                                                    "gpt_neox": ("query_key_value",)}
# A mixture of experts' fused expert parameters (transformers 5's Qwen3MoeExperts / GptOssExperts), which peft adapts
# only through `target_parameters` (its `ParamWrapper`; TRL: `lora_target_parameters`) -> our experts' adapters
# (`transformer.MoE`): gate_up_proj is our experts_gate and experts_up sharing one A, as Phi-3's gate_up_proj
LORA_EXPERT_PARAMETERS: dict[str, str] = {"mlp.experts.gate_up_proj": "gate_up", "mlp.experts.down_proj": "down"}


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """Low-rank adapters on some projections: y = x W + scale * dropout(x) A B, A [din, r], B [r, dout].

    `targets` are Hugging Face module names of the family (`LORA_MODULES`); scale = alpha / r, or alpha / sqrt(r)
    with `use_rslora` (peft's rsLoRA). Dropout applies to the adapter's input in training forwards only.
    `target_parameters`: a mixture of experts' expert parameters with adapters (peft's `target_parameters`,
    `LORA_EXPERT_PARAMETERS`): per expert e, W_e + scale * A_e B_e, A_e [din, r], B_e [r, dout].
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    use_rslora: bool = False
    # our projection names the targets select in the spec's family ("q", "k", "v", "o", "gate", "up", "down"; fused:
    # "qkv", "gate_up"), resolved once by `lora_spec`
    modules: frozenset[str] = frozenset()
    target_parameters: tuple[str, ...] = ()
    # the expert projections `target_parameters` selects ("gate_up", "down"), resolved by `lora_spec`
    experts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.targets and not self.modules:
            raise ValueError("a LoRASpec's modules are resolved by lora_spec(family, ...); build it there")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def expert_parameters(names: Any) -> tuple[str, ...]:
    """peft `target_parameters` -> the expert parameters they name, canonical (`LORA_EXPERT_PARAMETERS`), in the
    order given. peft matches a parameter whose dotted name is a target or ends with "." + a target, so any
    dotted suffix of "mlp.experts.gate_up_proj" names it (a model's routed layers hold it under
    model.layers.{i}.mlp.experts). Example: ["experts.down_proj", "mlp.experts.gate_up_proj"] ->
    ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")."""
    chosen = []
    for name in [names] if isinstance(names, str) else list(names or ()):
        full = [p for p in LORA_EXPERT_PARAMETERS if p == name or p.endswith(f".{name}")]
        if not full:
            raise ModelLoadError(f"lora_target_parameters: {name} is not an expert parameter; choose from "
                                 f"{', '.join(LORA_EXPERT_PARAMETERS)} (a mixture of experts' fused experts)")
        chosen += full
    return tuple(dict.fromkeys(chosen))


def lora_spec(
    family: str, rank: int, alpha: float, dropout: float = 0.0, targets: Any = None, use_rslora: bool = False,
    target_parameters: Any = None,
) -> LoRASpec:
    """A validated `LoRASpec` for a family: `targets` None -> peft's defaults, "all-linear" -> every projection
    of the blocks (not the LM head, as peft), else HF module names (`LORA_MODULES`); `target_parameters`: expert
    parameters too (`expert_parameters`; peft refuses them with dropout, and so do we)."""
    names = LORA_MODULES[family]
    if targets is None:
        chosen = LORA_DEFAULT_TARGETS[family]
    elif targets in ("all-linear", ["all-linear"], ("all-linear",)):
        chosen = tuple(names)
    else:
        chosen = tuple(dict.fromkeys(str(t) for t in targets))
        unknown = [t for t in chosen if t not in names]
        if unknown or not (chosen or target_parameters):  # [] with expert parameters: the experts alone (peft)
            raise ModelLoadError(
                f"lora_target_modules: {', '.join(unknown) or '(none)'} is not a projection of a {family} model; "
                f"choose from {', '.join(names)} or all-linear"
            )
    if rank < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise ModelLoadError(f"LoRA needs rank >= 1, alpha > 0, 0 <= dropout < 1 (got {rank}, {alpha}, {dropout})")
    params = expert_parameters(target_parameters)
    if params and dropout:
        # peft's ParamWrapper: dropout(x) cannot be factored out of x (W + A B), so it raises; an adapter folder with
        # both would not load there
        raise ModelLoadError(f"lora_target_parameters needs lora_dropout 0 (got {dropout}): peft's adapters on "
                             "expert parameters refuse dropout (TRL's default lora_dropout is 0.05)")
    return LoRASpec(int(rank), float(alpha), float(dropout), chosen, bool(use_rslora),
                    frozenset(names[t] for t in chosen), params, frozenset(LORA_EXPERT_PARAMETERS[p] for p in params))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model description; hashable so a module's graphdef can be a jit static argument.

    `hf_config` (the original `config.json` dict) is kept for export and excluded from hashing/equality.
    """

    family: str  # "llama" | "phi3" | "gpt_neox"
    model_type: str  # HF model_type: a key of MODEL_TYPES
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
    rope_type: str = "default"  # "default" | "linear" | "llama3" | "longrope" | "yarn"
    # e.g. (("factor", 8.0), ("low_freq_factor", 1.0), ...); longrope: short_factor / long_factor are tuples
    rope_factors: tuple[tuple[str, Any], ...] = ()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = False
    sliding_window: int | None = None  # a key is visible iff q_pos - k_pos < sliding_window (in sliding layers)
    # per layer "full_attention" | "sliding_attention" (HF's `layer_types`); () with a sliding_window: every layer
    # slides (Mistral, Phi-3)
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (default rope); None: as global
    rope_layers: tuple[bool, ...] = ()  # SmolLM3: False for a layer without RoPE (NoPE); (): every layer
    qk_norm: str = ""  # "" | "head": RMSNorm of each head's q and k (Qwen3, Gemma 3) | "full": of the whole q and k
    # projections (OLMo 2); before RoPE
    norm_layout: str = "pre"  # "pre": x + f(norm(x)); "sandwich" (Gemma): x + norm(f(norm(x))); "post" (OLMo 2):
    # x + norm(f(x))
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + w) with w the stored weight
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the compute dtype
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    initializer_range: float = 0.02
    # mixture of experts (0 experts: every MLP dense). A routed layer (`sparse_layers`) sends each token to
    # num_experts_per_tok of num_experts gated MLPs of moe_intermediate_size; the other layers are dense MLPs of
    # intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer, True where routed; (): every layer when num_experts > 0
    norm_topk_prob: bool = False  # the k chosen probabilities renormalised to sum to 1
    router_aux_loss_coef: float = 0.0  # the checkpoint's load-balancing loss weight (TRL's default for the option)
    router_bias: bool = False  # GPT-OSS: the router's logits have a bias [E]
    router_topk_softmax: bool = False  # GPT-OSS: weights = softmax of the top-k logits (else top-k of the softmax)
    expert_bias: bool = False  # GPT-OSS: each expert's gate / up / down projections have biases
    swiglu_limit: float | None = None  # GPT-OSS: the experts' clamped SwiGLU (`moe.clamped_swiglu`); None: silu
    swiglu_alpha: float = 1.702  # its sigmoid gain (with swiglu_limit)
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in each attention softmax's denominator
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # execution choices (never exported to config.json): how the L blocks run and what their backward keeps
    # jax.lax.scan over the stacked blocks (False: unrolled; the same numbers). Read as False for a model whose layers
    # mix dense and routed MLPs (one scanned block has one structure)
    scan_layers: bool = True
    remat_policy: str = "none"  # a key of REMAT_POLICIES
    lora: LoRASpec | None = None  # low-rank adapters on some projections (None: the plain model)
    # the block projections' kernels stored quantized, dequantized in the forward (QLoRA's frozen base; None: plain)
    quant: QuantSpec | None = None
    # how the forwards compute attention (`attention.IMPLEMENTATIONS`: eager, splash, cudnn); None: the best for
    # the platform compiled for. Decoding keeps its one-query einsum whatever this says.
    attn_implementation: str | None = None
    # how a routed MLP's grouped matmuls run (`moe.IMPLEMENTATIONS`: ragged_dot, megablox); None: the best for the
    # platform compiled for (megablox on TPU)
    moe_implementation: str | None = None
    # a mixture of experts given recorded routes (`transformer.Routes`, the sampler's): True routes each token to
    # them (routing replay; gate weights from the current router logits), False lets the router choose
    routing_replay: bool = True
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
        if self.moe_implementation not in (None, *MOE_IMPLEMENTATIONS):
            raise ModelLoadError(f"moe_implementation={self.moe_implementation!r}; supported: "
                                 f"{', '.join(MOE_IMPLEMENTATIONS)} or None (the best for the platform)")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        for name in ("layer_types", "rope_layers"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ModelLoadError(f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ModelLoadError(f"layer_types {', '.join(bad)} not supported; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelLoadError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.qk_norm not in ("", "head", "full") or self.norm_layout not in NORM_LAYOUTS:
            raise ModelLoadError(f"qk_norm={self.qk_norm!r} / norm_layout={self.norm_layout!r}: supported "
                                 f"'', head, full / {', '.join(NORM_LAYOUTS)}")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ModelLoadError(f"{name}={getattr(self, name)} must be > 0 (or None)")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                                     f"{self.num_experts}] and moe_intermediate_size={self.moe_intermediate_size} >= 1")
            if self.moe_layers and len(self.moe_layers) != self.num_layers:
                raise ModelLoadError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.attention_sinks and self.attn_implementation == "cudnn":
            raise ModelLoadError(f"attn_implementation={self.attn_implementation!r} cannot compute attention sinks "
                                 f"({self.model_type}); use attn_implementation='eager'")
        if self.scan_layers and len(set(self.sparse_layers)) > 1:
            # a scan runs one block structure; layers mixing dense and routed MLPs (`mlp_only_layers`) run
            # unrolled, and every reader of `scan_layers` (the checkpoint tables, the resume layout) sees it
            object.__setattr__(self, "scan_layers", False)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global attention)."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def rope_kinds(self) -> tuple[int, ...]:
        """Each layer's RoPE table: 0 the global one, 1 the local one (sliding layers, `local_rope_theta`), 2 none
        (NoPE)."""
        local = self.local_rope_theta is not None
        return tuple(2 if self.rope_layers and not self.rope_layers[i] else int(local and w is not None)
                     for i, w in enumerate(self.windows))

    @property
    def attn_scale(self) -> float:
        """The factor on q k^T: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Each layer's MLP: True routed (a mixture of experts), False dense."""
        if not self.num_experts:
            return (False,) * self.num_layers
        return self.moe_layers or (True,) * self.num_layers

    @property
    def is_moe(self) -> bool:
        """Some layer routes its tokens to experts."""
        return any(self.sparse_layers)

    @property
    def gated_mlp(self) -> bool:
        """down(act(gate(x)) * up(x)) (llama, phi3), else down(act(up(x))) (gpt_neox)."""
        return self.family != "gpt_neox"

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (e.g. `cfg.replace(dtype="bfloat16")`)."""
        return dataclasses.replace(self, **changes)


def rope_inv_freq(
    rotary_dim: int, theta: float, rope_type: str = "default", factors: tuple[tuple[str, Any], ...] = (),
    long: bool = False,
) -> np.ndarray:
    """Inverse rotary frequencies, as HF `modeling_rope_utils`, float32 [rotary_dim // 2].

    default: inv_freq_i = theta ** (-2i / rotary_dim).  linear: inv_freq / factor.
    llama3: wavelen = 2 pi / inv_freq; wavelen > old_len / low_ff -> inv_freq / factor; wavelen < old_len / high_ff
    -> unchanged; in between s = (old_len / wavelen - low_ff) / (high_ff - low_ff), (1 - s) inv / factor + s inv.
    longrope (Phi-3): inv_freq_i / ext_i with ext = short_factor, or long_factor when `long` (a forward that reaches
    past original_max_position_embeddings; `Transformer.rope_tables` picks).
    yarn: `yarn_inv_freq`.
    Example: rope_inv_freq(4, 10000.0) -> [1.0, 0.01].
    """
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)))
    f = dict(factors)
    if rope_type == "yarn":
        return yarn_inv_freq(rotary_dim, theta, f["factor"], f["beta_fast"], f["beta_slow"],
                             f["original_max_position_embeddings"], f["truncate"])
    if rope_type == "linear":
        return (inv / np.float32(f["factor"])).astype(np.float32)
    if rope_type == "longrope":
        ext = np.asarray(f["long_factor" if long else "short_factor"], np.float32)
        base = np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
        return (np.float32(1.0) / (ext * base)).astype(np.float32)
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


def yarn_inv_freq(rotary_dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float, old_len: float,
                  truncate: bool) -> np.ndarray:
    """YaRN's inverse frequencies (HF `_compute_yarn_parameters`), float32 [rotary_dim // 2]: a blend per dim i of
    the extrapolated theta ** (-2i / d) and the interpolated theta ** (-2i / d) / factor,
    inv_i = interp_i (1 - w_i) + extrap_i w_i with w_i = 1 - clip((i - low) / (high - low), 0, 1), where
    low / high = d ln(old_len / (2 pi beta_fast / beta_slow)) / (2 ln theta) (floored / ceiled with `truncate`),
    clipped to [0, d - 1]. Example: factor 1 -> theta ** (-2i / d) whatever the betas."""
    d = rotary_dim

    def correction_dim(rotations: float) -> float:
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF: prevents the singularity
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_w = (np.float32(1) - ramp).astype(np.float32)
    pos_freqs = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    extrap = np.float32(1) / pos_freqs
    interp = np.float32(1) / (np.float32(factor) * pos_freqs)
    return (interp * (np.float32(1) - extrapolation_w) + extrap * extrapolation_w).astype(np.float32)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's default factor on cos and sin (HF): g(factor, mscale) / g(factor, mscale_all_dim) when both are set,
    else g(factor, 1), g(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1). Example: factor 32 -> 1.3466."""
    def g(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return g(factor, mscale) / g(factor, mscale_all_dim) if mscale and mscale_all_dim else g(factor)


def rope_attention_factor(rope_type: str, factors: tuple[tuple[str, Any], ...]) -> float:
    """The factor HF multiplies cos and sin by: longrope's and yarn's `attention_factor` (longrope's default
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), 1 for factor <= 1; yarn's `yarn_attention_factor`,
    resolved at load); 1.0 for the other types."""
    return float(dict(factors).get("attention_factor", 1.0)) if rope_type in ("longrope", "yarn") else 1.0


def _require(hf: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if hf.get(k) is not None:
            return hf[k]
    raise ModelLoadError(f"config.json lacks {' / '.join(keys)}")


def _supported_list() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def family_and_task(hf: dict[str, Any]) -> tuple[str, str | None]:
    """(family, task) from `architectures[0]` (task None when only `model_type` is known); ModelLoadError naming
    the supported architectures for any other."""
    archs = hf.get("architectures") or []
    if archs:
        if archs[0] not in ARCHITECTURES:
            hint = ""
            if archs[0] == "Gemma3ForConditionalGeneration":
                hint = " (the multimodal Gemma 3: use a text-only Gemma3ForCausalLM checkpoint)"
            raise ModelLoadError(f"unsupported architecture {archs[0]!r}{hint}; supported: {_supported_list()}")
        return ARCHITECTURES[archs[0]]
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {mt!r}; supported: {', '.join(sorted(MODEL_TYPES))} "
                             f"(architectures: {_supported_list()})")
    return MODEL_TYPES[mt][0], None


def _model_type(hf: dict[str, Any], family: str) -> str:
    """config.json's model_type, or the one its architecture implies."""
    mt = hf.get("model_type")
    if mt in MODEL_TYPES and MODEL_TYPES[mt][0] == family:
        return mt
    archs = hf.get("architectures") or []
    if archs and archs[0] in ARCHITECTURE_MODEL_TYPES:
        return ARCHITECTURE_MODEL_TYPES[archs[0]]
    raise ModelLoadError(f"model_type {mt!r} does not match the {family} family")


# HF config classes' defaults where config.json may omit a key and the class default is not hidden // heads
_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "gpt_oss": 64}
_KV_HEADS = {"gpt_oss": 8}  # where the class default is not num_attention_heads
_ATTENTION_BIAS = {"gpt_oss"}  # attention_bias defaults to True
_THETA = {"smollm3": 2_000_000.0, "gemma3_text": 1_000_000.0, "gpt_oss": 150_000.0}
_EPS = {"olmo2": 1e-5, "phi3": 1e-5, "gpt_oss": 1e-5}
# GptOssConfig's rope when config.json has none
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_TIED = {"qwen2", "gemma2", "gemma3_text", "smollm3"}


def _rope_dict(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The (global) rope dict: `rope_parameters` (new) or `rope_scaling` (old; Phi-3 prefers it), flat. Gemma 3's
    is nested per layer type: its full_attention entry (its sliding_attention one: `_local_rope_theta`)."""
    rp = hf.get("rope_parameters")
    if model_type == "phi3" and hf.get("rope_scaling"):
        rp = hf["rope_scaling"]
    rp = dict(rp or hf.get("rope_scaling") or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        rp = dict(rp.get("full_attention") or {})
    elif model_type == "gemma3_text" and hf.get("rope_parameters") is None and hf.get("rope_scaling"):
        rp = dict(hf["rope_scaling"])  # old Gemma 3 files: rope_scaling is the global layers' (e.g. linear x8)
    if model_type == "gpt_oss" and not rp:
        rp = dict(_GPT_OSS_ROPE)
    return rp


def _local_rope_theta(hf: dict[str, Any], model_type: str) -> float | None:
    """Gemma 3's sliding layers' RoPE base: rope_parameters.sliding_attention.rope_theta, or the old
    `rope_local_base_freq` (default 10000); None for the other models."""
    if model_type != "gemma3_text":
        return None
    local = dict((hf.get("rope_parameters") or {}).get("sliding_attention") or {})
    rope_type = local.get("rope_type", local.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"Gemma 3 sliding-layer rope_type {rope_type!r} is not supported (default only)")
    return float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))


def _rope_settings(hf: dict[str, Any], head_dim: int, default_prf: float, model_type: str = "") -> dict[str, Any]:
    """Rotary settings from the new `rope_parameters` dict or the old top-level keys / `rope_scaling`."""
    rp = _rope_dict(hf, model_type)
    theta = rp.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", _THETA.get(model_type, 10000.0))))
    prf = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", default_prf)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # as Phi3Config maps them
    if rope_type not in ROPE_TYPES or model_type not in ROPE_TYPES_OF.get(rope_type, (model_type,)):
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES[:3])} "
                             "(and longrope for Phi-3, yarn for GPT-OSS)")
    rotary_dim = int(head_dim * float(prf))
    factors: tuple[tuple[str, Any], ...] = ()
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
    elif rope_type == "yarn":
        # HF: factor defaults to max_position_embeddings / original_max_position_embeddings, the betas to 32 / 1,
        # truncate to True; attention_factor (on cos and sin) to `yarn_attention_factor`
        old_len = float(rp.get("original_max_position_embeddings") or hf["max_position_embeddings"])
        factor = float(rp.get("factor") or float(hf["max_position_embeddings"]) / old_len)
        attention = rp.get("attention_factor")
        if attention is None:
            attention = yarn_attention_factor(factor, rp.get("mscale"), rp.get("mscale_all_dim"))
        factors = (("factor", factor), ("beta_fast", float(rp.get("beta_fast") or 32)),
                   ("beta_slow", float(rp.get("beta_slow") or 1)), ("original_max_position_embeddings", old_len),
                   ("truncate", bool(rp.get("truncate", True))), ("attention_factor", float(attention)))
    elif rope_type == "longrope":
        # HF: the top-level original_max_position_embeddings wins over the rope dict's; factor defaults to
        # max_position_embeddings / it, attention_factor to sqrt(1 + ln(factor) / ln(old_len)) (1 if factor <= 1)
        old_len = hf.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or \
            hf.get("max_position_embeddings")
        factor = rp.get("factor") or float(hf.get("max_position_embeddings", old_len)) / float(old_len)
        attention = rp.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        short, long_ = (tuple(float(x) for x in rp[k]) for k in ("short_factor", "long_factor"))
        if len(short) != rotary_dim // 2 or len(long_) != rotary_dim // 2:
            raise ModelLoadError(f"longrope short_factor / long_factor need {rotary_dim // 2} entries, got "
                                 f"{len(short)} / {len(long_)}")
        factors = (("short_factor", short), ("long_factor", long_),
                   ("original_max_position_embeddings", float(old_len)), ("attention_factor", float(attention)))
    return {"rope_theta": float(theta), "rotary_dim": rotary_dim, "rope_type": rope_type, "rope_factors": factors}


def _layer_types(hf: dict[str, Any], model_type: str, layers: int, window: int | None) -> tuple[str, ...]:
    """Per-layer attention kinds: config.json's `layer_types`, else what each HF config class derives."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if model_type in ("gemma2", "gpt_oss"):
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    if model_type == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern", 6))
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    if model_type == "qwen3" and window is not None:
        first = int(hf.get("max_window_layers", 28))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    return ()


def _llama_flags(hf: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The llama family's per-model flags (see `ModelConfig`)."""
    flags: dict[str, Any] = {}
    window = hf.get("sliding_window")
    if model_type == "mistral":
        return {"sliding_window": None if window is None else int(window)}
    if model_type == "qwen2":
        if hf.get("use_sliding_window"):
            raise ModelLoadError("Qwen2 with use_sliding_window=True is not supported")
        return flags
    if model_type == "gpt_oss":
        flags = _gpt_oss_flags(hf)
        window = hf.get("sliding_window", 128)
    elif model_type == "qwen3_moe":  # q/k norms as Qwen3; with use_sliding_window every layer slides
        window = int(window) if hf.get("use_sliding_window") and window is not None else None
        return {"qk_norm": "head", "sliding_window": window, **_moe_flags(hf, model_type, layers)}
    if model_type in ("qwen3", "smollm3") and not hf.get("use_sliding_window"):
        window = None  # as the config classes: the window applies only with use_sliding_window
    if model_type in ("gemma2", "gemma3_text"):
        if hf.get("use_bidirectional_attention"):
            raise ModelLoadError("Gemma with use_bidirectional_attention=True is not a causal LM")
        window = hf.get("sliding_window", 4096)
        gemma2 = model_type == "gemma2"
        flags.update(
            norm_layout="sandwich", norm_offset=1.0, embed_scale=True,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            attn_softcap=hf.get("attn_logit_softcapping", 50.0 if gemma2 else None),
            final_softcap=hf.get("final_logit_softcapping", 30.0 if gemma2 else None),
            qk_norm="" if gemma2 else "head",
            local_rope_theta=_local_rope_theta(hf, model_type),
        )
        flags["attn_softcap"] = None if flags["attn_softcap"] is None else float(flags["attn_softcap"])
        flags["final_softcap"] = None if flags["final_softcap"] is None else float(flags["final_softcap"])
    if model_type == "qwen3":
        flags["qk_norm"] = "head"
    if model_type == "olmo2":
        flags.update(qk_norm="full", norm_layout="post")
    if model_type == "smollm3":
        nope = hf.get("no_rope_layers") or [int((i + 1) % int(hf.get("no_rope_layer_interval", 4)) != 0)
                                            for i in range(layers)]
        flags["rope_layers"] = tuple(bool(x) for x in nope)
    types = _layer_types(hf, model_type, layers, window)
    if "sliding_attention" not in types:
        types, window = (), None  # no layer slides: no window (whatever sliding_window says)
    flags.update(sliding_window=None if window is None else int(window), layer_types=types)
    return flags


# Settings of other mixtures of experts that change the math and that transformers' Qwen3-MoE does not have: a
# config setting one is refused (`_refuse_moe_options`), never silently computed as Qwen3-MoE's routing.
# (key, is it on, what it is)
_MOE_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("shared_expert_intermediate_size", bool, "a shared expert (Qwen2-MoE's)"),
    ("num_shared_experts", bool, "shared experts"),
    ("n_shared_experts", bool, "shared experts (DeepSeek's)"),
    ("router_type", lambda v: v not in ("topk", "top_k", "token_choice"), "a routing other than each token's top-k "
     "experts (e.g. expert choice)"),
    ("routing_type", lambda v: v not in ("topk", "top_k", "token_choice"), "a routing other than each token's top-k "
     "experts (e.g. expert choice)"),
    ("scoring_func", lambda v: v != "softmax", "a router score other than the softmax"),
    ("topk_method", lambda v: v != "greedy", "group-limited routing (DeepSeek's)"),
    ("n_group", lambda v: v not in (0, 1), "group-limited routing (DeepSeek's)"),
    ("topk_group", lambda v: v not in (0, 1), "group-limited routing (DeepSeek's)"),
    ("routed_scaling_factor", lambda v: v != 1, "scaled routed outputs"),
    ("first_k_dense_replace", bool, "dense first layers (DeepSeek's; Qwen3-MoE's spelling is mlp_only_layers)"),
    ("moe_capacity_factor", bool, "expert capacity (token dropping)"),
    ("capacity_factor", bool, "expert capacity (token dropping)"),
    ("router_jitter_noise", bool, "router noise"),
    ("router_bias", bool, "a router bias"),
)


def _refuse_moe_options(hf: dict[str, Any], model_type: str) -> None:
    """One ModelLoadError naming every `_MOE_REFUSED` option the config sets (None counts as unset)."""
    bad = [f"{name}={hf[name]!r} ({what})" for name, on, what in _MOE_REFUSED if hf.get(name) is not None and
           on(hf[name])]
    if bad:
        raise ModelLoadError(f"{model_type} checkpoint: {'; '.join(bad)} not supported (Qwen3-MoE's routing: each "
                             "token to its top-k experts of softmax(router logits), all computed, none dropped)")


def _gpt_oss_flags(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's expert and attention settings with GptOssConfig's defaults: every layer routed to the top
    `num_experts_per_tok` (4) of `num_local_experts` (128; the hub's spelling `num_experts` read alike) experts of
    `intermediate_size`, weights the softmax of their logits; router and expert biases, the clamped SwiGLU,
    attention sinks. An MXFP4 `quantization_config` is read dequantized (`hf.py`); any other quantization, and the
    other mixtures' options (`_MOE_REFUSED`), are refused."""
    _refuse_moe_options(hf, "gpt_oss")
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ModelLoadError(f"gpt_oss checkpoint: quantization_config with quant_method="
                             f"{quant.get('quant_method')!r} not supported (MXFP4, dequantized on load, or none)")
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    return dict(num_experts=int(128 if experts is None else experts),
                num_experts_per_tok=int(hf.get("num_experts_per_tok") or 4),
                moe_intermediate_size=int(hf.get("intermediate_size") or 2880),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                router_bias=True, router_topk_softmax=True, expert_bias=True, attention_sinks=True,
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _moe_flags(hf: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert settings (see `ModelConfig`) with Qwen3MoeConfig's defaults, from either spelling of the
    expert count (`num_experts`, the hub's; `num_local_experts`, what transformers 5 writes). A layer is routed as
    Qwen3MoeDecoderLayer decides: not in `mlp_only_layers`, and (i + 1) % decoder_sparse_step == 0."""
    _refuse_moe_options(hf, model_type)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    experts = int(128 if experts is None else experts)
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
    if not any(sparse):
        return {}  # no routed layer: a dense model
    return dict(num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 8),
                moe_intermediate_size=int(hf.get("moe_intermediate_size") or 768),
                moe_layers=() if all(sparse) else sparse, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def config_from_hf(hf: dict[str, Any], dtype: str = "float32", param_dtype: str | None = None) -> ModelConfig:
    """Build a `ModelConfig` from a HF `config.json` dict (old and new rope formats)."""
    family, _ = family_and_task(hf)
    model_type = _model_type(hf, family)
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    layers = int(_require(hf, "num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or _HEAD_DIM.get(model_type, hidden // heads))
    common = dict(
        family=family,
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
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
    if family == "phi3":
        window = hf.get("sliding_window")
        flags: dict[str, Any] = {"sliding_window": None if window is None else int(window)}
    else:
        flags = _llama_flags(hf, model_type, layers)
    bias = bool(hf.get("attention_bias", model_type in _ATTENTION_BIAS))
    qkv_bias = model_type == "qwen2" or (family == "llama" and bias)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or \
        ("gelu_pytorch_tanh" if model_type in ("gemma2", "gemma3_text") else "silu")
    return ModelConfig(
        **common,
        num_kv_heads=int(hf.get("num_key_value_heads") or _KV_HEADS.get(model_type, heads)),
        norm_eps=float(hf.get("rms_norm_eps", _EPS.get(model_type, 1e-6))),
        hidden_act=act,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in _TIED)),
        qkv_bias=qkv_bias,
        o_bias=family == "llama" and model_type != "qwen2" and bias,
        mlp_bias=family == "llama" and model_type != "qwen3_moe" and bool(hf.get("mlp_bias", False)),
        parallel_residual=False,
        **flags,
        **_rope_settings(hf, head_dim, 1.0, model_type),
    )


def _rope_out(cfg: ModelConfig) -> dict[str, Any]:
    """The global rope dict as HF writes it (lists for longrope's factors)."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    for k, v in cfg.rope_factors:
        rope[k] = list(v) if isinstance(v, tuple) else v
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return rope


def config_to_hf(cfg: ModelConfig, architecture: str) -> dict[str, Any]:
    """The HF `config.json` dict for export: the original dict with every field we use written explicitly.

    Rope settings are written in both the new (`rope_parameters`) and old (top-level) forms, with equal values
    (Gemma 3: nested per layer type; Phi-3: `original_max_position_embeddings` at the top level, as it reads it).
    """
    hf = dict(cfg.hf_config)
    for k in ("rope_scaling", "rope_theta", "rotary_pct", "rotary_emb_base", "partial_rotary_factor",
              "rope_local_base_freq"):
        hf.pop(k, None)
    prf = cfg.rotary_dim / cfg.head_dim
    rope = _rope_out(cfg)
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
    )
    hf.pop("torch_dtype", None)
    if cfg.family == "gpt_neox":
        hf.update(
            rope_theta=cfg.rope_theta,
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_residual,
            attention_bias=cfg.qkv_bias,
            rotary_pct=prf,
            rotary_emb_base=cfg.rope_theta,
            rope_parameters={**rope, "partial_rotary_factor": prf},
        )
        return hf
    hf.update(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              rms_norm_eps=cfg.norm_eps)
    mt = cfg.model_type
    if mt == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
        hf["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    elif mt == "phi3":
        if "original_max_position_embeddings" in rope:
            hf["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        hf.update(rope_theta=cfg.rope_theta, rope_parameters={**rope, "partial_rotary_factor": prf})
    else:
        hf.update(rope_theta=cfg.rope_theta, rope_parameters=rope)
        if cfg.rope_type != "default":
            hf["rope_scaling"] = dict(rope)
    if mt not in ("qwen2", "gemma2", "gemma3_text", "phi3"):
        hf.update(attention_bias=cfg.qkv_bias, **({} if mt in ("qwen3_moe", "gpt_oss") else {"mlp_bias": cfg.mlp_bias}))
    if mt in ("gemma2", "gemma3_text"):
        qpas = cfg.query_pre_attn_scalar
        qpas = int(qpas) if qpas is not None and float(qpas).is_integer() else qpas  # HF's field is an int
        hf.update(hidden_activation=cfg.hidden_act, query_pre_attn_scalar=qpas,
                  attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
                  attention_bias=cfg.qkv_bias)
    if mt == "smollm3":
        hf["no_rope_layers"] = [int(x) for x in cfg.rope_layers] if cfg.rope_layers else [1] * cfg.num_layers
    if cfg.layer_types or mt in ("qwen3", "smollm3", "gemma2", "gemma3_text", "gpt_oss"):  # these derive their own
        hf["layer_types"] = list(cfg.layer_types or ("full_attention",) * cfg.num_layers)
    if mt in ("qwen3", "smollm3", "qwen3_moe"):
        hf["use_sliding_window"] = cfg.sliding_window is not None
    if mt in ("mistral", "phi3", "qwen3", "smollm3", "gemma2", "gemma3_text", "qwen3_moe", "gpt_oss"):
        hf["sliding_window"] = cfg.sliding_window
    if mt == "qwen3_moe":
        hf.update(_moe_out(cfg, hf))
    if mt == "gpt_oss":
        hf.update(_gpt_oss_out(cfg, hf))
    return hf


def _gpt_oss_out(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's expert keys for config.json (the expert count under the checkpoint's spelling, as `_moe_out`); the
    weights are written dequantized (float32 / bf16), so an MXFP4 `quantization_config` is dropped."""
    hf.pop("quantization_config", None)
    spelling = "num_experts" if "num_experts" in hf and "num_local_experts" not in hf else "num_local_experts"
    hf.pop("num_local_experts" if spelling == "num_experts" else "num_experts", None)
    return {spelling: cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "intermediate_size": cfg.moe_intermediate_size, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha}


def _moe_out(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert keys for config.json: the expert count under one spelling (the checkpoint's hub
    `num_experts`, else transformers 5's `num_local_experts`; never both), the routed layers as `mlp_only_layers`
    with decoder_sparse_step 1 (the same layers, whatever the checkpoint's step was)."""
    spelling = "num_experts" if "num_experts" in hf and "num_local_experts" not in hf else "num_local_experts"
    other = "num_local_experts" if spelling == "num_experts" else "num_experts"
    hf.pop(other, None)
    return {spelling: cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, s in enumerate(cfg.sparse_layers) if not s]}
