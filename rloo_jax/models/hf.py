"""Hugging Face checkpoints in and out: one weight table per family drives both loading and export.

A table row maps one HF tensor to one or more of our parameters with a transform and its inverse:
HF `nn.Linear.weight` [out, in] <-> our kernel [in, out] (transpose); GPT-NeoX `query_key_value` [H*3*Dh, D]
(interleaved per head: view [H, 3, Dh, D]) <-> our q, k, v kernels [D, H*Dh]; Phi-3's `qkv_proj`
[(H+2K)*Dh, D] and `gate_up_proj` [2F, D] (stacked: [q; k; v], [gate; up]) <-> our q, k, v / gate, up kernels.
Reading uses safetensors' numpy backend tensor by tensor (bf16 tensors are read from the raw bytes, which numpy
cannot name), converting each to the param dtype as it goes, into a module built abstractly with `nnx.eval_shape`
(no random init).
No torch anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from rloo_jax.errors import ConfigError
from rloo_jax.models.config import (
    ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    architecture_names,
    config_from_hf,
    config_to_hf,
    family_and_task,
)
from rloo_jax.models.moe import mxfp4_dequantize
from rloo_jax.models.transformer import CausalLM, RewardModel

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
# Tensors some checkpoints carry that are buffers, not weights (old Pythia files; rotary caches).
_IGNORED = re.compile(r"(\.attention\.(bias|masked_bias)$)|(rotary_emb\.inv_freq$)")


# ----------------------------------------------------------------------------------------------- transforms
@dataclasses.dataclass(frozen=True)
class Transform:
    """HF tensor <-> our arrays. `to_ours(a) -> tuple`, `to_hf(tuple) -> a`, `hf_shape(our shapes) -> shape`."""

    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray]
    hf_shape: Callable[[tuple[tuple[int, ...], ...]], tuple[int, ...]]


IDENTITY = Transform(lambda a: (a,), lambda p: p[0], lambda s: tuple(s[0]))
TRANSPOSE = Transform(lambda a: (a.T,), lambda p: p[0].T, lambda s: tuple(s[0])[::-1])


def fused_qkv(num_heads: int, is_bias: bool) -> Transform:
    """GPT-NeoX `query_key_value`: weight [H*3*Dh, D] viewed [H, 3, Dh, D] <-> q, k, v kernels [D, H*Dh];
    bias [H*3*Dh] viewed [H, 3, Dh] <-> q, k, v biases [H*Dh]."""
    h = num_heads

    def to_ours(a: np.ndarray) -> tuple[np.ndarray, ...]:
        if is_bias:
            x = a.reshape(h, 3, -1)
            return tuple(x[:, j].reshape(-1) for j in range(3))
        x = a.reshape(h, 3, -1, a.shape[-1])
        return tuple(x[:, j].reshape(-1, a.shape[-1]).T for j in range(3))

    def to_hf(parts: tuple[np.ndarray, ...]) -> np.ndarray:
        if is_bias:
            return np.stack([p.reshape(h, -1) for p in parts], axis=1).reshape(-1)
        d = parts[0].shape[0]
        return np.stack([p.T.reshape(h, -1, d) for p in parts], axis=1).reshape(-1, d)

    def hf_shape(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        n = sum(s[-1] for s in shapes)
        return (n,) if is_bias else (n, shapes[0][0])

    return Transform(to_ours, to_hf, hf_shape)


def stacked(sizes: tuple[int, ...]) -> Transform:
    """A fused `nn.Linear` whose outputs are our projections one after another (Phi-3's `qkv_proj` [q; k; v],
    `gate_up_proj` [gate; up]): weight [sum(sizes), din] <-> kernels [din, size_i] (LoRA's B [sum(sizes), r] <->
    [r, size_i] alike). Example: sizes (2, 1): rows 0-1 -> the first kernel's columns, row 2 -> the second's."""
    cuts = np.cumsum(sizes)[:-1]

    def to_ours(a: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(x.T for x in np.split(a, cuts, axis=0))

    def to_hf(parts: tuple[np.ndarray, ...]) -> np.ndarray:
        return np.concatenate([x.T for x in parts], axis=0)

    return Transform(to_ours, to_hf, lambda s: (sum(x[-1] for x in s), s[0][0]))


@dataclasses.dataclass(frozen=True)
class Row:
    """One HF tensor name <-> our parameter paths (dot-joined, e.g. "model.layers.attn.q.kernel"); `layer` is the
    index on the leading layer axis of a stacked block parameter (None for the others), `expert` the index on the
    experts' axis that follows it (a hub Qwen3-MoE file holds one tensor per expert; None for the others)."""

    hf: str
    ours: tuple[str, ...]
    transform: Transform
    layer: int | None = None
    expert: int | None = None

    @property
    def at(self) -> tuple[int, ...]:
        """The leading indices of our parameters this tensor fills: (layer, expert) as present; () for all of it."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _fused_experts(f: int) -> Transform:
    """transformers' in-memory Qwen3-MoE experts, `gate_up_proj` [E, 2F, D] (gate rows first) <-> our gate and up
    [E, D, F]. Example: F 1, rows [g; u] of expert e -> gate[e] = g^T, up[e] = u^T."""
    return Transform(lambda a: (a[:, :f].transpose(0, 2, 1), a[:, f:].transpose(0, 2, 1)),
                     lambda p: np.concatenate([x.transpose(0, 2, 1) for x in p], axis=1),
                     lambda s: (s[0][0], 2 * s[0][2], s[0][1]))


# GPT-OSS's `gate_up_proj` [E, D, 2F] (and its bias [E, 2F]): gate and up interleaved on the last axis (gate at even
# columns, up at odd ones, as GptOssExperts._apply_gate slices them) <-> our gate and up [E, D, F] ([E, F])
INTERLEAVED = Transform(lambda a: (a[..., ::2], a[..., 1::2]),
                        lambda p: np.stack(p, axis=-1).reshape(*p[0].shape[:-1], 2 * p[0].shape[-1]),
                        lambda s: (*s[0][:-1], 2 * s[0][-1]))

EXPERTS_TRANSPOSE = Transform(lambda a: (a.transpose(0, 2, 1),), lambda p: p[0].transpose(0, 2, 1),
                              lambda s: (s[0][0], s[0][2], s[0][1]))


HALVES = Transform(lambda a: tuple(np.split(a, 2, axis=-1)), lambda p: np.concatenate(p, axis=-1),
                   lambda s: (*s[0][:-1], 2 * s[0][-1]))  # Qwen3-MoE's gate_up_proj: [gate; up] on the output axis


def expert_lora_a(num_experts: int) -> Transform:
    """peft's `ParamWrapper` lora_A.weight [E * r, din] (row e * r + j: rank j of expert e) <-> our A [E, din, r].
    Example: E 2, r 1, din 1: rows [[a0], [a1]] -> A[0] = [[a0]], A[1] = [[a1]]."""
    e = num_experts
    return Transform(lambda a: (a.reshape(e, -1, a.shape[-1]).transpose(0, 2, 1),),
                     lambda p: p[0].transpose(0, 2, 1).reshape(-1, p[0].shape[1]),
                     lambda s: (s[0][0] * s[0][2], s[0][1]))


def expert_lora_b(num_experts: int, join: Transform = IDENTITY) -> Transform:
    """peft's `ParamWrapper` lora_B.weight [dout, r * E] (column j * E + e: rank j of expert e, as its
    `get_delta_weight` reshapes it [dout, r, E]) <-> our B [E, r, dout]; gate_up_proj's output axis `join`s our
    gate's and up's B [E, r, F] (`HALVES` for Qwen3-MoE, `INTERLEAVED` for GPT-OSS, as the weight's). Example:
    E 2, r 1, dout 1: [[b0, b1]] -> B[0] = [[b0]], B[1] = [[b1]]."""
    e = num_experts

    def to_ours(a: np.ndarray) -> tuple[np.ndarray, ...]:
        return join.to_ours(a.reshape(a.shape[0], -1, e).transpose(2, 1, 0))

    def to_hf(parts: tuple[np.ndarray, ...]) -> np.ndarray:
        full = join.to_hf(parts)  # [E, r, dout]
        return full.transpose(2, 1, 0).reshape(full.shape[2], -1)

    def hf_shape(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        n, r, dout = join.hf_shape(shapes)
        return (dout, r * n)

    return Transform(to_ours, to_hf, hf_shape)


def _expert_adapter_rows(cfg: ModelConfig) -> list[Row]:
    """The experts' adapters as peft saves them (`target_parameters`, config.LORA_EXPERT_PARAMETERS): each
    targeted parameter of `model.layers.{i}.mlp.experts` wraps the module in a `ParamWrapper`, the first
    parameter the module registers (gate_up_proj, then down_proj) innermost, so with both targeted gate_up_proj's
    adapter is `mlp.experts.base_layer.lora_A.weight` and down_proj's `mlp.experts.lora_A.weight`."""
    on = [n for n in ("gate_up", "down") if n in cfg.lora.experts]
    join = INTERLEAVED if cfg.model_type == "gpt_oss" else HALVES
    a, rows = expert_lora_a(cfg.num_experts), []
    for i in range(cfg.num_layers):
        if not cfg.sparse_layers[i]:
            continue
        us, layer = _layer(cfg, i)
        for depth, name in enumerate(on):
            hf = f"base_model.model.model.layers.{i}.mlp.experts." + "base_layer." * (len(on) - 1 - depth)
            ours = f"{us}.mlp.experts_{name}"
            b = (f"{us}.mlp.experts_gate_lora_b", f"{us}.mlp.experts_up_lora_b") if name == "gate_up" else \
                (f"{ours}_lora_b",)
            rows.append(Row(f"{hf}lora_A.weight", (f"{ours}_lora_a",), a, layer))
            rows.append(Row(f"{hf}lora_B.weight", b, expert_lora_b(cfg.num_experts, join if len(b) == 2 else
                                                                   IDENTITY), layer))
    return rows


def _gpt_oss_moe_rows(hf: str, us: str, layer: int | None) -> list[Row]:
    """GPT-OSS's routed MLP as its files (dequantized) and transformers hold it: the router `mlp.router.weight`
    [E, D] and bias [E]; `mlp.experts.gate_up_proj` [E, D, 2F] and its bias [E, 2F] (`INTERLEAVED`),
    `mlp.experts.down_proj` [E, F, D] (our layout) and its bias [E, D]. MXFP4 files: `Mxfp4Tensors`."""
    experts, ours = f"{hf}.mlp.experts", f"{us}.mlp.experts"
    return [Row(f"{hf}.mlp.router.weight", (f"{us}.mlp.router",), TRANSPOSE, layer),
            Row(f"{hf}.mlp.router.bias", (f"{us}.mlp.router_bias",), IDENTITY, layer),
            Row(f"{experts}.gate_up_proj", (f"{ours}_gate", f"{ours}_up"), INTERLEAVED, layer),
            Row(f"{experts}.gate_up_proj_bias", (f"{ours}_gate_bias", f"{ours}_up_bias"), INTERLEAVED, layer),
            Row(f"{experts}.down_proj", (f"{ours}_down",), IDENTITY, layer),
            Row(f"{experts}.down_proj_bias", (f"{ours}_down_bias",), IDENTITY, layer)]


def _moe_rows(cfg: ModelConfig, hf: str, us: str, layer: int | None, fused: bool) -> list[Row]:
    """A routed MLP's tensors: the router `mlp.gate.weight` [E, D] and, as the hub and transformers 5's
    `save_pretrained` write them, one gate / up / down `nn.Linear` weight per expert (`mlp.experts.{e}.*_proj`, into
    expert e of our stacked [E, ...] kernels); `fused`: transformers' in-memory form instead, `mlp.experts.gate_up_proj`
    [E, 2F, D] and `mlp.experts.down_proj` [E, D, F] (read when a file holds it)."""
    rows = [Row(f"{hf}.mlp.gate.weight", (f"{us}.mlp.router",), TRANSPOSE, layer)]
    names = {n: f"{us}.mlp.experts_{n}" for n in ("gate", "up", "down")}
    if fused:
        return rows + [Row(f"{hf}.mlp.experts.gate_up_proj", (names["gate"], names["up"]),
                           _fused_experts(cfg.moe_intermediate_size), layer),
                       Row(f"{hf}.mlp.experts.down_proj", (names["down"],), EXPERTS_TRANSPOSE, layer)]
    return rows + [Row(f"{hf}.mlp.experts.{e}.{n}_proj.weight", (names[n],), TRANSPOSE, layer, e)
                   for e in range(cfg.num_experts) for n in ("gate", "up", "down")]


def _linear(hf: str, ours: str, bias: bool, layer: int | None = None) -> list[Row]:
    rows = [Row(f"{hf}.weight", (f"{ours}.kernel",), TRANSPOSE, layer)]
    return rows + ([Row(f"{hf}.bias", (f"{ours}.bias",), IDENTITY, layer)] if bias else [])


def _norm(hf: str, ours: str, bias: bool, layer: int | None = None) -> list[Row]:
    rows = [Row(f"{hf}.weight", (f"{ours}.scale",), IDENTITY, layer)]
    return rows + ([Row(f"{hf}.bias", (f"{ours}.bias",), IDENTITY, layer)] if bias else [])


def _layer(cfg: ModelConfig, i: int) -> tuple[str, int | None]:
    """Where block i's parameters live: ("model.layers", i) in the stacked layout, ("model.layers.i", None) in the
    list layout (`scan_layers` False)."""
    return ("model.layers", i) if cfg.scan_layers else (f"model.layers.{i}", None)


# HF norm name -> ours, per `norm_layout` (HF's "post_attention_layernorm" is the pre-MLP norm of a pre-norm block)
_NORMS = {
    "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"},
    "sandwich": {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
                 "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"},
    "post": {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"},
}


def _llama_rows(cfg: ModelConfig, fused_experts: bool = False) -> list[Row]:
    """The llama and phi3 families (Phi-3: q/k/v and gate/up fused in the file); routed MLPs: `_moe_rows`."""
    rows = [Row("model.embed_tokens.weight", ("model.embed.embedding",), IDENTITY)]
    kv, f = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        hf, (us, layer) = f"model.layers.{i}", _layer(cfg, i)
        for theirs, ours in _NORMS[cfg.norm_layout].items():
            rows += _norm(f"{hf}.{theirs}", f"{us}.{ours}", False, layer)
        if cfg.family == "phi3":
            qkv = tuple(f"{us}.attn.{n}.kernel" for n in "qkv")
            rows.append(Row(f"{hf}.self_attn.qkv_proj.weight", qkv, stacked((cfg.num_heads * cfg.head_dim, kv, kv)),
                            layer))
        else:
            for n in "qkv":
                rows += _linear(f"{hf}.self_attn.{n}_proj", f"{us}.attn.{n}", cfg.qkv_bias, layer)
        rows += _linear(f"{hf}.self_attn.o_proj", f"{us}.attn.o", cfg.o_bias, layer)
        if cfg.qk_norm:
            rows += _norm(f"{hf}.self_attn.q_norm", f"{us}.attn.q_norm", False, layer)
            rows += _norm(f"{hf}.self_attn.k_norm", f"{us}.attn.k_norm", False, layer)
        if cfg.attention_sinks:
            rows.append(Row(f"{hf}.self_attn.sinks", (f"{us}.attn.sinks",), IDENTITY, layer))
        if cfg.sparse_layers[i] and cfg.model_type == "gpt_oss":
            rows += _gpt_oss_moe_rows(hf, us, layer)
        elif cfg.sparse_layers[i]:
            rows += _moe_rows(cfg, hf, us, layer, fused_experts)
        elif cfg.family == "phi3":
            gate_up = (f"{us}.mlp.gate.kernel", f"{us}.mlp.up.kernel")
            rows.append(Row(f"{hf}.mlp.gate_up_proj.weight", gate_up, stacked((f, f)), layer))
            rows += _linear(f"{hf}.mlp.down_proj", f"{us}.mlp.down", False, layer)
        else:
            for n in ("gate", "up", "down"):
                rows += _linear(f"{hf}.mlp.{n}_proj", f"{us}.mlp.{n}", cfg.mlp_bias, layer)
    return rows + _norm("model.norm", "model.final_norm", False)


def _gpt_neox_rows(cfg: ModelConfig) -> list[Row]:
    rows = [Row("gpt_neox.embed_in.weight", ("model.embed.embedding",), IDENTITY)]
    for i in range(cfg.num_layers):
        hf, (us, layer) = f"gpt_neox.layers.{i}", _layer(cfg, i)
        qkv = tuple(f"{us}.attn.{n}" for n in "qkv")
        rows += _norm(f"{hf}.input_layernorm", f"{us}.attn_norm", True, layer)
        fused = f"{hf}.attention.query_key_value"
        rows.append(Row(f"{fused}.weight", tuple(f"{p}.kernel" for p in qkv), fused_qkv(cfg.num_heads, False), layer))
        if cfg.qkv_bias:
            rows.append(Row(f"{fused}.bias", tuple(f"{p}.bias" for p in qkv), fused_qkv(cfg.num_heads, True), layer))
        rows += _linear(f"{hf}.attention.dense", f"{us}.attn.o", cfg.o_bias, layer)
        rows += _norm(f"{hf}.post_attention_layernorm", f"{us}.mlp_norm", True, layer)
        rows += _linear(f"{hf}.mlp.dense_h_to_4h", f"{us}.mlp.up", True, layer)
        rows += _linear(f"{hf}.mlp.dense_4h_to_h", f"{us}.mlp.down", True, layer)
    return rows + _norm("gpt_neox.final_layer_norm", "model.final_norm", True)


def weight_table(cfg: ModelConfig, task: str, fused_experts: bool = False) -> list[Row]:
    """All rows for a model: backbone + `lm_head` (causal_lm, untied) or `score` (reward). `fused_experts`: a
    mixture of experts' experts as transformers holds them in memory (`_moe_rows`), else one tensor per expert."""
    rows = _gpt_neox_rows(cfg) if cfg.family == "gpt_neox" else _llama_rows(cfg, fused_experts)
    if task == "reward":
        return rows + [Row("score.weight", ("score.kernel",), TRANSPOSE)]
    if not cfg.tie_word_embeddings:
        head = "embed_out.weight" if cfg.family == "gpt_neox" else "lm_head.weight"
        rows.append(Row(head, ("lm_head.kernel",), TRANSPOSE))
    return rows


def adapter_table(cfg: ModelConfig) -> list[Row]:
    """PEFT adapter tensors <-> our `lora_a`/`lora_b`, derived from the weight table: the adapter of HF module
    `X` is `base_model.model.X.lora_A.weight` [r, din] (transposed A) and `...lora_B.weight` [dout, r], whose
    layout is the module weight's with r for din (so a fused B goes through the same `fused_qkv` / `stacked`);
    the experts' (`target_parameters`): `_expert_adapter_rows`."""
    if cfg.lora is None:
        return []
    ours, rows = cfg.lora.modules, []
    for r in weight_table(cfg, "causal_lm"):
        modules = [p.removesuffix(".kernel") for p in r.ours]
        if not all(p.endswith(".kernel") for p in r.ours) or not r.hf.endswith(".weight") or r.expert is not None:
            continue  # not a projection's kernel (norms, the router, the experts: no adapters)
        hf = "base_model.model." + r.hf.removesuffix(".weight")
        if len(modules) == 3 and "qkv" in ours:  # fused q/k/v: one A in the attention module
            a = modules[0].rsplit(".", 1)[0] + ".qkv_lora_a"
        elif len(modules) == 2 and "gate_up" in ours:  # Phi-3's fused gate/up: one A in the MLP
            a = modules[0].rsplit(".", 1)[0] + ".gate_up_lora_a"
        elif len(modules) == 1 and modules[0].rsplit(".", 1)[-1] in ours:
            a = modules[0] + ".lora_a"
        else:
            continue
        rows.append(Row(f"{hf}.lora_A.weight", (a,), TRANSPOSE, r.layer))
        rows.append(Row(f"{hf}.lora_B.weight", tuple(f"{m}.lora_b" for m in modules), r.transform, r.layer))
    return rows + (_expert_adapter_rows(cfg) if cfg.lora.experts else [])


def architecture_name(cfg: ModelConfig, task: str) -> str:
    """HF class name to write in `config.json` for export."""
    name = architecture_names(cfg.model_type)[0 if task == "causal_lm" else 1]
    assert name in ARCHITECTURES, name
    return name


# ----------------------------------------------------------------------------------------------- reading
def resolve_checkpoint(path_or_hub_id: str | Path, weights: bool = True) -> Path:
    """A local checkpoint directory, or a hub snapshot (config, safetensors, tokenizer files only; without the
    safetensors when `weights` is False). A name that means a local path (`rloo_jax.outputs.is_local_path`: it
    starts with /, ./, ../ or ~, cannot be a hub id, or starts with an existing local folder) but does not exist is
    a ModelLoadError naming it, never a hub download."""
    from rloo_jax.outputs import is_local_path

    p = Path(path_or_hub_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ModelLoadError(f"{p} is a file; expected a checkpoint directory")
    s = str(path_or_hub_id)
    if not s or is_local_path(s):
        raise ModelLoadError(f"checkpoint path does not exist: {s} (no folder {p.absolute()}; a hub id is `name` or "
                             "`namespace/name`)")
    try:
        from huggingface_hub import snapshot_download

        patterns = HUB_PATTERNS if weights else [x for x in HUB_PATTERNS if x != "*.safetensors"]
        return Path(snapshot_download(s, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, auth: one clear error
        raise ModelLoadError(f"checkpoint {s!r}: no such local directory and hub download failed: {e}") from e


def has_attention_sinks(directory: str | Path) -> bool:
    """Whether the checkpoint in `directory` has attention sinks (GPT-OSS), from its config.json."""
    return config_from_hf(read_hf_config(Path(directory))).attention_sinks


def read_hf_config(directory: Path) -> dict[str, Any]:
    """`config.json` as a dict."""
    f = directory / "config.json"
    if not f.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    return json.loads(f.read_text())


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights (convert .bin checkpoints to safetensors)")
    return files


def _header(file: Path) -> tuple[dict[str, Any], int]:
    """safetensors header: {name: {dtype, shape, data_offsets}} and the byte offset where data starts."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class TensorReader:
    """Tensor-by-tensor access to all safetensors files of a checkpoint (single or sharded)."""

    def __init__(self, directory: Path) -> None:
        self.entries: dict[str, tuple[Path, dict[str, Any], int]] = {}
        for file in _safetensors_files(directory):
            header, start = _header(file)
            for name, info in header.items():
                self.entries[name] = (file, info, start)

    def names(self) -> set[str]:
        return set(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array in its stored dtype (bf16 via ml_dtypes)."""
        file, info, start = self.entries[name]
        if info["dtype"] != "BF16":
            from safetensors import safe_open

            with safe_open(str(file), framework="numpy") as f:
                return f.get_tensor(name)
        lo, hi = info["data_offsets"]
        with open(file, "rb") as f:
            f.seek(start + lo)
            raw = f.read(hi - lo)
        return np.frombuffer(raw, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


class Mxfp4Tensors:
    """A checkpoint's tensors with each MXFP4 pair `X_blocks` [E, R, G, 16] uint8 / `X_scales` [E, R, G] uint8 (GPT-OSS
    experts, quant_method mxfp4) shown as the one float32 tensor `X` [E, G * 32, R] it encodes
    (`moe.mxfp4_dequantize`, transformers' `convert_moe_packed_tensors`); the other tensors as `reader` gives them.
    Loading then casts to the param dtype: the experts are held dequantized."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        names = reader.names()
        self.packed = {n.removesuffix("_blocks") for n in names
                       if n.endswith("_blocks") and n.removesuffix("_blocks") + "_scales" in names}

    def names(self) -> set[str]:
        hidden = {f"{n}{suffix}" for n in self.packed for suffix in ("_blocks", "_scales")}
        return (self.reader.names() - hidden) | self.packed

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return self.reader.shape(name)
        e, r, g, b = self.reader.shape(f"{name}_blocks")
        return (e, g * b * 2, r)

    def get(self, name: str) -> np.ndarray:
        if name not in self.packed:
            return self.reader.get(name)
        return mxfp4_dequantize(self.reader.get(f"{name}_blocks"), self.reader.get(f"{name}_scales"))


def _flat_paths(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_paths(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _set_path(tree: dict[Any, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        tree = tree[int(k)] if k.isdigit() else tree[k]  # nnx.List entries are keyed by int
    tree[keys[-1]] = value


def _fill(model_cls: type, cfg: ModelConfig, task: str, reader: TensorReader) -> nnx.Module:
    """Build `model_cls(cfg)` abstractly and fill every parameter from the checkpoint (all keys checked first)."""
    abstract = nnx.eval_shape(lambda: model_cls(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    ours = dict(_flat_paths(pure))
    if any(n.endswith("_blocks") for n in reader.names()):  # MXFP4 experts (GPT-OSS): read dequantized
        reader = Mxfp4Tensors(reader)
    names = reader.names()
    rows = weight_table(cfg, task, fused_experts=any(n.endswith(".mlp.experts.gate_up_proj") for n in names))
    expected = {r.hf for r in rows}
    missing = sorted(expected - names)
    tied_head = {"lm_head.weight", "embed_out.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in names - expected if not _IGNORED.search(n) and n not in tied_head)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint weights do not match {model_cls.__name__} ({cfg.model_type}):"
            + (f"\n  missing: {', '.join(missing)}" if missing else "")
            + (f"\n  unexpected: {', '.join(unexpected)}" if unexpected else "")
        )
    covered = {p for r in rows for p in r.ours}
    if covered != set(ours):
        raise AssertionError(f"weight table and module disagree: {sorted(covered ^ set(ours))}")
    for r in rows:
        want = r.transform.hf_shape(tuple(_row_shape(ours[p].shape, r) for p in r.ours))
        if reader.shape(r.hf) != want:
            raise ModelLoadError(f"tensor {r.hf}: checkpoint shape {reader.shape(r.hf)}, expected {want}")
    _read_rows(rows, reader, pure, ours, jnp.dtype(cfg.param_dtype))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _read_rows(rows: list[Row], reader: TensorReader, pure: dict, ours: dict[str, Any], pdt: Any) -> None:
    """Every row's tensor into `pure` (our nested dict; `ours`: its flat shapes), cast to `pdt` as each is read.
    One parameter at a time (all layers of a stacked one): the host holds at most one stacked parameter, never
    a second full-precision copy of the checkpoint."""
    groups: dict[tuple[str, ...], list[Row]] = {}
    for r in rows:
        groups.setdefault(r.ours, []).append(r)
    for paths, group in groups.items():
        host = {p: np.empty(ours[p].shape, pdt) for p in paths} if group[0].at else {}
        for r in group:
            src = reader.get(r.hf)
            for path, part in zip(paths, r.transform.to_ours(src), strict=True):
                if not r.at:
                    _set_path(pure, path, jnp.asarray(part.astype(pdt, order="C", copy=False)))
                else:
                    host[path][r.at] = part
            del src
        for path, value in host.items():
            _set_path(pure, path, jnp.asarray(value))
        del host


def _row_shape(shape: tuple[int, ...], row: Row) -> tuple[int, ...]:
    """Our parameter's shape as one HF tensor sees it: without the layer (and expert) axes it indexes."""
    return tuple(shape[len(row.at):])


def _config(
    path_or_hub_id: str | Path, want_task: str, dtype: str, param_dtype: str | None, weights: bool, options: dict
) -> tuple[ModelConfig, Path]:
    directory = resolve_checkpoint(path_or_hub_id, weights)
    return config_of(read_hf_config(directory), str(directory), want_task, dtype, param_dtype, options), directory


def config_of(
    hf: dict[str, Any], where: str, want_task: str, dtype: str = "float32", param_dtype: str | None = None,
    options: dict | None = None,
) -> ModelConfig:
    """Our `ModelConfig` of a HF config dict (`config.json`, or a loaded model's `config.to_dict()`; `where` names
    it in errors), checked to be a supported architecture of `want_task` ("causal_lm" | "reward", num_labels 1)."""
    _, task = family_and_task(hf)
    if task is not None and task != want_task:
        kind = "a causal LM" if want_task == "causal_lm" else "a reward model (*ForSequenceClassification)"
        raise ModelLoadError(f"{where} holds {hf['architectures'][0]}, not {kind}")
    if want_task == "reward" and int(hf.get("num_labels", len(hf.get("id2label") or {0: 0}))) != 1:
        raise ModelLoadError(f"{where}: a reward model needs num_labels=1")
    options = options or {}
    try:
        return config_from_hf(hf, dtype, param_dtype).replace(**options)
    except TypeError as e:  # an unknown execution option
        raise ModelLoadError(f"model options {sorted(options)}: {e}") from None


def check_checkpoint(path_or_hub_id: str | Path, task: str = "causal_lm") -> ModelConfig:
    """Read a checkpoint's `config.json` (a local folder, or a hub snapshot without its weights) and check it is a
    model we build: a supported architecture of the right task with a config we read (ModelLoadError naming the
    supported architectures otherwise). No weights are read; a PEFT adapter folder checks its base model. Returns
    its `ModelConfig`."""
    directory = resolve_checkpoint(path_or_hub_id, weights=False)
    adapter = directory / ADAPTER_CONFIG
    if task == "causal_lm" and adapter.is_file():  # as load_causal_lm: the adapter's base
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not base:
            raise ModelLoadError(f"{adapter} has no base_model_name_or_path")
        return check_checkpoint(base, task)
    cfg, _ = _config(directory, task, "float32", None, False, {})
    return cfg


def check_checkpoints(policy: str | Path, rewards: Any = ()) -> None:
    """`check_checkpoint` the policy (unless it is the built-in `demo`) and every reward entry that is a local
    folder (a reward model), before anything is loaded or trained: what `RLOOTrainer(...)` (and so the CLI) calls
    at construction, so an unsupported model fails there, not after the run has started."""
    if str(policy) != "demo":
        check_checkpoint(policy, "causal_lm")
    for r in rewards:
        if isinstance(r, str | Path) and Path(r).expanduser().is_dir():
            check_checkpoint(r, "reward")


def load_causal_lm(
    path_or_hub_id: str | Path,
    dtype: str = "float32",
    param_dtype: str | None = None,
    rngs: nnx.Rngs | None = None,
    **options: Any,
) -> CausalLM:
    """Load a HF causal LM (an architecture of `config.ARCHITECTURES`, safetensors) as a `CausalLM`; a PEFT LoRA
    adapter folder (`adapter_config.json`) loads its base model with the adapters (`load_adapter`).

    dtype: compute dtype ("float32" | "bfloat16"); param_dtype: storage dtype (default: dtype); `options`:
    execution fields of `ModelConfig` (`scan_layers`, `remat_policy`). `rngs` is accepted for interface symmetry
    with random init; loading draws no randomness.
    """
    del rngs
    directory = resolve_checkpoint(path_or_hub_id)
    if (directory / ADAPTER_CONFIG).is_file():
        return load_adapter(directory, dtype, param_dtype, **options)
    cfg, directory = _config(directory, "causal_lm", dtype, param_dtype, True, options)
    return _fill(CausalLM, cfg, "causal_lm", TensorReader(directory))


def load_reward_model(
    path_or_hub_id: str | Path,
    dtype: str = "float32",
    param_dtype: str | None = None,
    rngs: nnx.Rngs | None = None,
    **options: Any,
) -> RewardModel:
    """Load a HF `*ForSequenceClassification` checkpoint with num_labels=1 as a `RewardModel`."""
    del rngs
    cfg, directory = _config(path_or_hub_id, "reward", dtype, param_dtype, True, options)
    return _fill(RewardModel, cfg, "reward", TensorReader(directory))


def load_value_model(
    path_or_hub_id: str | Path, dtype: str = "float32", param_dtype: str | None = None, seed: int = 0, **options: Any
) -> RewardModel:
    """A value model as TRL's PPO scripts load one (`AutoModelForSequenceClassification.from_pretrained(path,
    num_labels=1)`): a `*ForSequenceClassification` checkpoint as it is (e.g. the reward model); a causal LM's
    backbone with a new `score` head, normal(0, initializer_range) from `seed` (its LM head unused)."""
    directory = resolve_checkpoint(path_or_hub_id)
    if family_and_task(read_hf_config(directory))[1] != "causal_lm":
        return load_reward_model(directory, dtype, param_dtype, **options)
    lm = load_causal_lm(directory, dtype, param_dtype, **options)
    model = nnx.eval_shape(lambda: RewardModel(lm.config, nnx.Rngs(0)))
    model.model = lm.model
    model.score = RewardModel.new_head(lm.config, seed)
    return model


def abstract_value_model(
    path_or_hub_id: str | Path, dtype: str = "float32", param_dtype: str | None = None, **options: Any
) -> RewardModel:
    """`load_value_model`'s model as shapes (`abstract_model`), from a sequence-classification or causal LM folder."""
    directory = resolve_checkpoint(path_or_hub_id, weights=False)
    task = family_and_task(read_hf_config(directory))[1]
    cfg, _ = _config(directory, "causal_lm" if task == "causal_lm" else "reward", dtype, param_dtype, False, options)
    return nnx.eval_shape(lambda: RewardModel(cfg, nnx.Rngs(0)))


def abstract_model(
    path_or_hub_id: str | Path, task: str = "causal_lm", dtype: str = "float32", param_dtype: str | None = None,
    **options: Any,
) -> CausalLM | RewardModel:
    """The model of a checkpoint folder with every parameter a `ShapeDtypeStruct`, from its `config.json` alone
    (no weights read or needed): for ahead-of-time compilation (`rloo_jax.aot`). task: "causal_lm" | "reward"."""
    cfg, _ = _config(path_or_hub_id, task, dtype, param_dtype, False, options)
    cls = CausalLM if task == "causal_lm" else RewardModel
    return nnx.eval_shape(lambda: cls(cfg, nnx.Rngs(0)))


def init_causal_lm(
    hf_config: dict[str, Any], seed: int = 0, dtype: str = "float32", param_dtype: str | None = None, **options: Any
) -> CausalLM:
    """A randomly initialised `CausalLM` from a HF-style config dict (needs `model_type` or `architectures`);
    `options`: execution fields of `ModelConfig`. Blocks are initialised one by one in order, so both layouts
    (`scan_layers` True or False) hold the same numbers for a seed."""
    return CausalLM(config_from_hf(dict(hf_config), dtype, param_dtype).replace(**options), nnx.Rngs(seed))


def init_reward_model(
    hf_config: dict[str, Any], seed: int = 0, dtype: str = "float32", param_dtype: str | None = None, **options: Any
) -> RewardModel:
    """A randomly initialised `RewardModel` from a HF-style config dict."""
    return RewardModel(config_from_hf(dict(hf_config), dtype, param_dtype).replace(**options), nnx.Rngs(seed))


# ----------------------------------------------------------------------------------------------- writing
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# transformers 5's `save_pretrained` default: one file up to 50 GB, past it `model-0000i-of-0000n.safetensors` shards
# and a `model.safetensors.index.json` (huggingface_hub's greedy split, tensors in table order)
MAX_SHARD_SIZE = "50GB"


def export_tensors(model: CausalLM | RewardModel, dtype: str = "float32") -> dict[str, np.ndarray]:
    """HF tensor name -> numpy array in `dtype` ("float32" | "bfloat16" | "float16"), through the same table as
    loading (adapters are not included: `save_adapter` writes them, `models.lora.merge_adapters` folds them in)."""
    task = "reward" if isinstance(model, RewardModel) else "causal_lm"
    source = _TensorSource(weight_table(model.config, task), model, dtype)
    return {r.hf: source.tensor(r) for r in source.rows}


class _TensorSource:
    """HF tensors computed one at a time from a model's parameters: each parameter is fetched to the host once, in
    its own dtype (a stacked one serves all its layers), and each tensor is converted to `dtype` as it is made, so
    the host holds the parameters plus the tensors being written, never a float32 copy of a bf16 model."""

    def __init__(self, rows: list[Row], model: nnx.Module, dtype: str) -> None:
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"export dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
        self.rows, self.dtype = rows, EXPORT_DTYPES[dtype]
        self._ours = dict(_flat_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
        self._host: dict[str, np.ndarray] = {}

    def shape(self, row: Row) -> tuple[int, ...]:
        return row.transform.hf_shape(tuple(_row_shape(self._ours[p].shape, row) for p in row.ours))

    def tensor(self, row: Row) -> np.ndarray:
        for p in row.ours:
            if p not in self._host:
                self._host[p] = np.asarray(jax.device_get(self._ours[p]))
        parts = tuple(
            (self._host[p][row.at] if row.at else self._host[p]).astype(np.float32, copy=False)
            for p in row.ours
        )
        return np.ascontiguousarray(row.transform.to_hf(parts).astype(self.dtype))


def _write_weights(source: _TensorSource, out: Path, name: str, max_shard_size: int | str) -> None:
    """`name` (e.g. `model.safetensors`) or, past `max_shard_size`, its shards and index as transformers 5 writes
    them; stale weight files of an earlier export in `out` are removed first."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file

    itemsize = np.dtype(source.dtype).itemsize
    shapes = {r.hf: source.shape(r) for r in source.rows}
    split = split_state_dict_into_shards_factory(
        shapes, get_storage_size=lambda shape: int(np.prod(shape, dtype=np.int64)) * itemsize,
        filename_pattern=name.replace(".safetensors", "{suffix}.safetensors"), max_shard_size=max_shard_size,
    )
    stem, index_name = name.removesuffix(".safetensors"), f"{name}.index.json"
    for old in out.glob(f"{stem}*.safetensors*"):
        if old.name not in split.filename_to_tensors and (old.name == index_name or old.name == name or re.fullmatch(
                rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.safetensors", old.name)):
            old.unlink()
    by_name = {r.hf: r for r in source.rows}
    for filename, names in split.filename_to_tensors.items():
        save_file({n: source.tensor(by_name[n]) for n in names}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        (out / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_pretrained(
    model: CausalLM | RewardModel, out_dir: str | Path, tokenizer: Any = None, dtype: str = "float32",
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Write `config.json` + the weights in `dtype` ("float32" | "bfloat16" | "float16"; `config.json` says which)
    (+ tokenizer files) loadable by transformers' `AutoModelForCausalLM` / `AutoModelForSequenceClassification` and
    by our loaders: one `model.safetensors`, or past `max_shard_size` (bytes or "5GB") shards with an index file."""
    task = "reward" if isinstance(model, RewardModel) else "causal_lm"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = config_to_hf(model.config, architecture_name(model.config, task))
    hf["dtype"] = dtype
    if task == "reward":
        hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    _write_weights(_TensorSource(weight_table(model.config, task), model, dtype), out, "model.safetensors",
                   max_shard_size)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


# ----------------------------------------------------------------------------------------------- LoRA adapters
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_adapter(
    model: CausalLM, out_dir: str | Path, base_model_name_or_path: str, tokenizer: Any = None, dtype: str = "float32"
) -> Path:
    """Write a PEFT LoRA adapter folder: `adapter_config.json` + `adapter_model.safetensors` in `dtype` (+ tokenizer
    files), which `peft.PeftModel.from_pretrained(base, out_dir)` and `load_causal_lm(out_dir)` load."""
    spec = model.config.lora
    if spec is None:
        raise ValueError("the model has no adapters")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(_TensorSource(adapter_table(model.config), model, dtype), out, ADAPTER_WEIGHTS, MAX_SHARD_SIZE)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.targets),
        "target_parameters": list(spec.target_parameters) or None,
        "use_rslora": spec.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def load_adapter(
    path_or_hub_id: str | Path, dtype: str = "float32", param_dtype: str | None = None, **options: Any
) -> CausalLM:
    """A PEFT LoRA adapter folder -> its base model (`base_model_name_or_path`, loaded by `load_causal_lm`) with
    the adapters filled from `adapter_model.safetensors`. LoRA variants we do not compute (DoRA, bias training,
    modules_to_save, per-layer ranks) are refused."""
    from rloo_jax.models.config import lora_spec
    from rloo_jax.models.lora import with_adapters

    directory = resolve_checkpoint(path_or_hub_id)
    ac = json.loads((directory / ADAPTER_CONFIG).read_text())
    unsupported = [
        k for k, ok in (
            ("peft_type", ac.get("peft_type", "LORA") == "LORA"),
            ("use_dora", not ac.get("use_dora")),
            ("bias", ac.get("bias", "none") == "none"),
            ("modules_to_save", not ac.get("modules_to_save")),
            ("rank_pattern", not ac.get("rank_pattern")),
            ("alpha_pattern", not ac.get("alpha_pattern")),
            ("layers_to_transform", ac.get("layers_to_transform") is None),
            ("fan_in_fan_out", not ac.get("fan_in_fan_out")),
        ) if not ok
    ]
    if unsupported:
        raise ModelLoadError(f"{directory / ADAPTER_CONFIG}: {', '.join(unsupported)} not supported (plain LoRA only)")
    base_path = ac.get("base_model_name_or_path")
    if not base_path:
        raise ModelLoadError(f"{directory / ADAPTER_CONFIG} has no base_model_name_or_path")
    base = load_causal_lm(base_path, dtype, param_dtype, **options)
    targets = ac.get("target_modules")
    targets = [t.rsplit(".", 1)[-1] for t in ([targets] if isinstance(targets, str) else targets or [])]
    try:
        spec = lora_spec(base.config.family, int(ac["r"]), float(ac["lora_alpha"]), float(ac.get("lora_dropout", 0)),
                         targets if targets or ac.get("target_parameters") else None,
                         bool(ac.get("use_rslora", False)), ac.get("target_parameters"))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{directory / ADAPTER_CONFIG}: {e}") from None
    return fill_adapters(with_adapters(base, spec, jax.random.key(0)), TensorReader(directory),
                         str(directory / ADAPTER_WEIGHTS))


def fill_adapters(model: CausalLM, reader: Any, where: str) -> CausalLM:
    """`model` (with adapters) with every adapter read from `reader` (PEFT's tensor names, `adapter_table`; a
    `TensorReader` or a loaded PeftModel's `rloo_jax.models.loaded.StateDictReader`), in the adapters' dtype;
    ModelLoadError naming `where` for a missing tensor or a wrong shape. An abstract model is returned as it is."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model))):
        return model  # compile-only: the shapes are all there is
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    ours = dict(_flat_paths(pure))
    rows = adapter_table(model.config)
    missing = sorted({r.hf for r in rows} - reader.names())
    if missing:
        raise ModelLoadError(f"{where} lacks {', '.join(missing[:4])}")
    unexpected = sorted(reader.names() - {r.hf for r in rows})
    if unexpected:  # an adapter on a module we do not adapt (the LM head, the embeddings) is refused, not dropped
        raise ModelLoadError(f"{where} holds adapters on modules LoRA does not target here: {', '.join(unexpected[:4])}"
                             " (plain LoRA on the projections of the blocks)")
    groups: dict[str, list[Row]] = {}
    for r in rows:
        want = r.transform.hf_shape(tuple(_row_shape(ours[p].shape, r) for p in r.ours))
        if reader.shape(r.hf) != want:
            raise ModelLoadError(f"tensor {r.hf}: adapter shape {reader.shape(r.hf)}, expected {want}")
        groups.setdefault(str(jnp.dtype(ours[r.ours[0]].dtype)), []).append(r)
    for dt, group in groups.items():  # the adapters' own dtype (param_dtype), not the base's
        _read_rows(group, reader, pure, ours, jnp.dtype(dt))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def adapter_base(directory: str | Path) -> str | None:
    """The base model a PEFT adapter folder names (`base_model_name_or_path` of its adapter_config.json); None for
    a folder without one (a plain model)."""
    f = Path(directory) / ADAPTER_CONFIG
    if not f.is_file():
        return None
    base = json.loads(f.read_text()).get("base_model_name_or_path")
    if not base:
        raise ModelLoadError(f"{f} has no base_model_name_or_path")
    return str(base)


# ----------------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(path_or_hub_id: str | Path, padding_side: str = "left") -> Any:
    """A transformers fast tokenizer with `padding_side` set and a pad token (falls back to eos).

    When the folder has a `tokenizer.json` we load exactly that file (`PreTrainedTokenizerFast`), so a model
    folder whose `config.json` says e.g. qwen2 cannot rebuild it as a different tokenizer class. (Only then is
    `AutoTokenizer` imported: its import, transformers' model registry and torch where installed, took 3 of a CLI
    run's first 5 CPU seconds.)
    """
    from transformers import PreTrainedTokenizerFast

    directory = resolve_checkpoint(path_or_hub_id)
    if (directory / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(str(directory), padding_side=padding_side)
    else:
        from transformers import AutoTokenizer

        try:  # never run code shipped with a checkpoint
            tok = AutoTokenizer.from_pretrained(str(directory), padding_side=padding_side, trust_remote_code=False)
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"cannot load the tokenizer at {directory}: {str(e).splitlines()[0]}") from e
    tok.padding_side = padding_side
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"tokenizer at {directory} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def eos_token_ids(model_dir: str, tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS plus every id in the model's generation_config.json (Qwen/Llama-3 have several)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            extra = json.load(f).get("eos_token_id")
        ids += [int(e) for e in (extra if isinstance(extra, list) else [extra]) if e is not None]
    return tuple(dict.fromkeys(ids))


def refuse_custom_code(model_dir: str) -> None:
    """A tokenizer that only loads through code shipped with the model (`auto_map` in tokenizer_config.json
    and no tokenizer.json) is refused before transformers could offer to run that code."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return  # loaded as a plain PreTrainedTokenizerFast: no custom code is consulted
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            auto_map = json.load(f).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # missing or unreadable: the loader reports it
    if auto_map:
        raise ModelLoadError(
            f"the tokenizer in {model_dir} needs code shipped with the model (auto_map in tokenizer_config.json); "
            "rloo_jax never runs such code, whatever trust_remote_code says: save a fast tokenizer "
            "(tokenizer.json) in that folder"
        )


def check_same_tokenizer(folder: str, what: str, vocab_size: int, tokenizer: Any) -> None:
    """A model that reads the policy's token ids must embed the same vocabulary: its config's vocab_size equals
    the policy's (`vocab_size`), and a tokenizer shipped in its folder has the policy `tokenizer`'s vocabulary (added
    tokens such as a pad token aside). `ModelLoadError` otherwise."""
    theirs = int(read_hf_config(Path(folder)).get("vocab_size", -1))
    ours = vocab_size
    if theirs != ours:
        raise ModelLoadError(
            f"the {what} at {folder} has another vocabulary than the policy ({theirs} against {ours} token "
            "embeddings): PPO scores the policy's token ids with it, as TRL does; use a model of the policy's "
            "tokenizer"
        )
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    try:
        other = load_tokenizer(folder)
    except ModelLoadError:
        return  # no usable tokenizer in the folder: the vocabulary size is all there is to check
    if base_vocab(other) != base_vocab(tokenizer):
        raise ModelLoadError(
            f"the {what} at {folder} comes with another tokenizer than the policy's: PPO scores the policy's token "
            "ids with it, as TRL does; use a model trained on the policy's tokenizer"
        )


def base_vocab(tokenizer: Any) -> dict[str, int]:
    """A tokenizer's vocabulary without its added tokens (a pad token added by a script aside)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab(with_added_tokens=False)
    added = set(getattr(tokenizer, "get_added_vocab", dict)())
    return {k: v for k, v in tokenizer.get_vocab().items() if k not in added}


def given_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer passed in (TRL's processing_class) made ready as `load_tokenizer` makes its own: left padding
    and a pad token (eos when it has none, as TRL)."""
    if not hasattr(tokenizer, "apply_chat_template") or not hasattr(tokenizer, "batch_decode"):
        raise ConfigError(f"processing_class must be a transformers tokenizer (got {type(tokenizer).__name__}); "
                          "processors of multimodal models are not supported")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError("processing_class has neither a pad nor an eos token; set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def head_model(folder: str, what: str, abstract: bool, vocab_size: int, tokenizer: Any, param_dtype: str,
               options: dict[str, Any], seed: int | None = None) -> RewardModel:
    """A model that scores the policy's token ids, from its checkpoint `folder` (checked to share the policy's
    tokenizer: `check_same_tokenizer`): with `seed` a value model trained with the policy (a sequence-classification
    checkpoint, or a causal LM's backbone with a new score head drawn from `seed`), else a frozen reward model; as
    shapes only when `abstract`. `options`: the policy's compute dtype and execution options
    (`numerics.model_options`); `param_dtype`: how it is stored."""
    check_same_tokenizer(folder, what, vocab_size, tokenizer)
    kinds = {k: options[k] for k in ("dtype", "scan_layers", "remat_policy", "attn_implementation",
                                     "moe_implementation")}
    if seed is not None:
        if abstract:
            return abstract_value_model(folder, param_dtype=param_dtype, **kinds)
        return load_value_model(folder, param_dtype=param_dtype, seed=seed, **kinds)
    if abstract:
        return abstract_model(folder, "reward", param_dtype=param_dtype, **kinds)
    return load_reward_model(folder, param_dtype=param_dtype, **kinds)
