"""What a run's programs should cost, to set the TPU compiler's figures against: model FLOPs, the decode loop's
memory floor and a roofline time.

Shapes are the padded ones the programs run (the compiler sees no others): B prompts of P tokens (the prompt
width, `max_prompt_length` rounded up to `prompt_bucket`), each continued by G completions of C tokens
(`max_completion_length`), N = B * G. A matmul of [m, k] by [k, n] is 2 m n k FLOPs.

Model FLOPs of one forward over a generation batch (`forward_flops`): every token goes through each layer's
matmuls once (2 * layer_params per token, layer_params = q, k, v, o and the MLP's matrices; norms, biases and the
embedding lookup are not matmuls), the positions that are scored through the unembedding (2 * D * V per
position), and attention's two matmuls (scores q k^T and the weighted sum of v: 4 * H * Dh per query-key pair),
counted causally: a token attends to itself and every earlier position of its row (within its layer's sliding
window: Gemma alternates windowed and global layers), never to the padding the program computes and masks. Norms
(Gemma's four per block, the q/k norms of Qwen3, Gemma 3 and OLMo 2) and soft-capping are elementwise, not counted;
Phi-3's fused qkv_proj and gate_up_proj are the same matmuls as separate ones. Tokens: each prompt runs once, shared
by its G completions (`Transformer.forward_shared_prompt`): B * P prompt tokens + N * C completion tokens through the
layers, N * C scored positions; query-key pairs per layer B * P (P + 1) / 2 + N * (C P + C (C + 1) / 2).

- update: 3 x forward per pass over the generation batch (the backward is two matmuls per forward matmul: the
  input's gradient and the weight's), x `num_iterations` passes. Full fine-tuning: every matrix is trained (with
  frozen matrices, e.g. LoRA, theirs need no weight gradient: 4 instead of 6 x params x tokens). LoRA's adapters
  are trained matrices of their own: 6 x adapter params x tokens more (`Transformer.tokens`).
- reference: 1 x forward (in the rollout program, with beta > 0).
- sampling: the prefill (B * P tokens, B scored positions) + C - 1 decode steps of N rows (the first token comes
  from the prefill's logits; step s feeds slot s - 1 at position P + s - 1, which attends to P + s keys).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


def causal_pairs(start: int, count: int, window: int | None = None) -> int:
    """Query-key pairs of `count` queries at positions start .. start+count-1, each attending to itself and every
    earlier position (the last `window` of them with a sliding window): sum over i of min(i + 1, window).

    Example: causal_pairs(0, 4) = 1 + 2 + 3 + 4 = 10; causal_pairs(2, 2) = 3 + 4 = 7; causal_pairs(0, 4, 2) = 7.
    """
    end = start + count  # keys seen by query i: i + 1 for i < end
    if window is None or window >= end:
        return end * (end + 1) // 2 - start * (start + 1) // 2
    below = max(min(end, window) - start, 0)  # queries i < window see i + 1 keys
    first = min(start, window)
    return (first + below) * (first + below + 1) // 2 - first * (first + 1) // 2 + (count - below) * window


def block_sparse_pairs(
    q_len: int, kv_len: int, block_q: int, block_kv: int, offset: int = 0, window: int | None = None
) -> int:
    """Query-key pairs one head of a block-sparse flash-attention kernel (splash) computes: block_q x block_kv for
    every (query block, key block) holding a visible pair, partial blocks whole. Query t sees key s iff
    0 <= t + offset - s (< window). q_len and kv_len are multiples of their blocks.

    Example: block_sparse_pairs(256, 256, 128, 128) = 3 * 128**2 = 49152 (two diagonal blocks, one below);
    block_sparse_pairs(128, 384, 128, 128, offset=256) = 3 * 128**2; with window 128: 2 * 128**2.
    """
    q0 = np.arange(q_len // block_q)[:, None] * block_q + offset  # the first shifted query index of each block
    k0 = np.arange(kv_len // block_kv)[None, :] * block_kv
    seen = q0 + block_q - 1 - k0 >= 0  # the largest t + offset - s of the block
    if window is not None:
        seen &= q0 - (k0 + block_kv - 1) <= window - 1  # the smallest
    return int(seen.sum()) * block_q * block_kv


def attention_kernel_flops(batch: int, heads: int, head_dim: int, pairs: int) -> float:
    """Matmul FLOPs of a flash-attention forward kernel: scores q k^T and probabilities x v, 2 * Dh each per
    query-key pair it computes, per query head and row: 4 * batch * heads * head_dim * pairs.

    Example: attention_kernel_flops(2, 3, 4, 5) = 480.
    """
    return 4.0 * batch * heads * head_dim * pairs


def forward_flops(
    layer_params: int,
    num_layers: int,
    unembed_params: int,
    attention_width: int,
    *,
    tokens: int,
    scored: int,
    pairs: int,
) -> float:
    """Matmul FLOPs of one forward: 2 * (L * layer_params * tokens + unembed_params * scored) + 4 * L * H * Dh *
    pairs, with `attention_width` = H * Dh (query heads x head dim) and `pairs` the query-key pairs of one layer.

    Example: forward_flops(10, 2, 6, 4, tokens=3, scored=2, pairs=6) = 2 * (60 + 12) + 4 * 2 * 4 * 6 = 336.
    """
    return (
        2.0 * (num_layers * layer_params * tokens + unembed_params * scored)
        + 4.0 * num_layers * attention_width * pairs
    )


@dataclasses.dataclass(frozen=True)
class Transformer:
    """The sizes model FLOPs and bytes need (from a `ModelConfig`: `Transformer.of(config)`)."""

    layer_params: float  # matmul parameters a token goes through in one block (q, k, v, o + MLP; the mean block)
    num_layers: int
    unembed_params: int  # D * V (the lm head, or the tied embedding)
    attention_width: int  # H * Dh
    kv_width: int  # K * Dh: keys (and values) cached per token and layer
    window: int | None = None  # the sliding window of every layer (None: global, or the layers differ: `windows`)
    windows: tuple[int | None, ...] = ()  # each layer's window when they differ (Gemma); (): `window` everywhere
    layer_bytes: float | None = None  # one block's matrices as stored when quantized (QLoRA); None: compute dtype
    # a mixture of experts: the routed blocks, their experts (E of `expert_params`: gate, up and down) and K, the
    # experts a token goes through (counted in `layer_params`); a decode step reads at most min(E, rows x K) of them
    routed_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    unquantized_params: float = 0.0  # of `layer_params`, what `layer_bytes` leaves out: the routers
    expert_bytes: float | None = None  # one expert's matrices as stored when quantized (QLoRA); None: compute dtype

    @classmethod
    def of(cls, config, quant=None) -> Transformer:  # noqa: ANN001 - a rloo_jax.models.ModelConfig, a QuantSpec
        """The sizes of `config`'s model; `quant` (default: the config's): its block matrices stored quantized.
        A mixture of experts' routed block counts its router (D x E) and the K experts a token goes through
        (`layer_params`, the FLOPs: the active parameters); with `quant` its experts are stored quantized as the
        other block matrices (`expert_bytes`), its router is not."""
        from rloo_jax.quant import stored_bytes

        d, dh, f = config.hidden_size, config.head_dim, config.intermediate_size
        hq, hk = config.num_heads * dh, config.num_kv_heads * dh
        # q, k, v, o + the MLP: gated (SwiGLU, GeGLU: gate, up, down) or not (up, down)
        attention = [(d, hq), (d, hk), (d, hk), (hq, d)]
        mlp = [*[(d, f)] * (2 if config.gated_mlp else 1), (f, d)]
        routed = sum(config.sparse_layers) if config.is_moe else 0
        dense, n = config.num_layers - routed, config.num_layers
        e, k = (config.num_experts, config.num_experts_per_tok) if routed else (0, 0)
        expert = 3 * d * config.moe_intermediate_size if routed else 0
        params = lambda ms: sum(i * o for i, o in ms)  # noqa: E731
        # the mean block: dense ones (attention + MLP), routed ones (attention + router + K experts)
        active = dense * params(attention + mlp) + routed * (params(attention) + d * e + k * expert)
        quant = quant or config.quant
        windows = config.windows
        uniform = len(set(windows)) == 1
        stored = expert_stored = None
        if quant is not None:  # the quantized matrices of the mean block (a routed one's router: not)
            fe = config.moe_intermediate_size if routed else 0
            expert_stored = sum(stored_bytes(i, o, quant) for i, o in ((d, fe), (d, fe), (fe, d))) if routed else 0.0
            stored = (dense * sum(stored_bytes(i, o, quant) for i, o in attention + mlp)
                      + routed * (sum(stored_bytes(i, o, quant) for i, o in attention) + k * expert_stored)) / n
        return cls(
            active / n if active % n else active // n,
            n,
            d * config.vocab_size,
            hq,
            hk,
            windows[0] if uniform else None,
            () if uniform else tuple(windows),
            stored,
            routed,
            e,
            k,
            expert,
            routed * d * e / n,
            expert_stored,
        )

    def layer_pairs(self, start: int, count: int) -> int:
        """Query-key pairs of `count` queries at positions start .. start+count-1 summed over the L layers, each
        within its own window (`causal_pairs`). Example: 2 layers, windows (2, None), start 0, count 4: 7 + 10."""
        if not self.windows:
            return self.num_layers * causal_pairs(start, count, self.window)
        return sum(causal_pairs(start, count, w) for w in self.windows)

    def _forward(self, tokens: int, scored: int, pairs: int) -> float:
        """`forward_flops` with `pairs` summed over the layers (`layer_pairs`), exact for per-layer windows."""
        return forward_flops(self.layer_params, self.num_layers, self.unembed_params, self.attention_width,
                             tokens=tokens, scored=scored, pairs=0) + 4.0 * self.attention_width * pairs

    @property
    def matmul_params(self) -> float:
        """Every matrix's parameters (a mixture of experts: all E experts, not the K a token uses)."""
        return self.num_layers * self.layer_params + self.unembed_params + self._idle_experts(None)

    def expert_read_bytes(self, itemsize: int, rows: int | None = None) -> float:
        """Bytes of the experts a step of `rows` rows reads, per routed block min(E, rows x K) (rows None: all E),
        as stored (quantized: `expert_bytes`) or at `itemsize`. Example: 2 routed blocks, E 8, K 2, expert_params
        30, rows 3, itemsize 2: 2 * 6 * 30 * 2 = 720."""
        read = self.num_experts if rows is None else min(self.num_experts, rows * self.experts_per_token)
        one = self.expert_params * itemsize if self.expert_bytes is None else self.expert_bytes
        return self.routed_layers * read * one

    def _idle_experts(self, rows: int | None) -> float:
        """Parameters of the experts no token goes through in `layer_params` that a step of `rows` rows still reads:
        per routed block min(E, rows x K) - K experts (rows None: all E)."""
        read = self.num_experts if rows is None else min(self.num_experts, rows * self.experts_per_token)
        return self.routed_layers * max(0, read - self.experts_per_token) * self.expert_params

    def split_bytes(self, itemsize: int) -> float:
        """Bytes at `itemsize` of the blocks' matrices other than the experts (q, k, v, o, a dense MLP, a router)
        that a decode step's rows can move to on an FSDP mesh (`weights_stay`); 0 where they are stored quantized
        (their codes are gathered). Example: layer_params 10, 2 layers, itemsize 2: 40; one routed block of K 2
        experts of 3 parameters: 28."""
        if self.layer_bytes is not None:
            return 0.0
        return (self.num_layers * self.layer_params
                - self.routed_layers * self.experts_per_token * self.expert_params) * itemsize

    def weight_bytes(self, itemsize: int, rows: int | None = None) -> float:
        """Bytes of every matrix a forward multiplies by: the blocks' as stored (`layer_bytes`: 4-bit codes at half
        a byte + their scales) or at `itemsize`, and the unembedding at `itemsize` (never quantized). A mixture of
        experts: every routed block's router at `itemsize` and the experts a step of `rows` rows can reach,
        min(E, rows x K) (rows None: all E), as stored (a decode step of N rows reads at most N x K experts of a
        block).

        Example: layer_params 10, 2 layers, unembed 6, itemsize 2: 52; with layer_bytes 6.5: 2 * 6.5 + 12 = 25.
        """
        if self.layer_bytes is None:
            return (self.num_layers * self.layer_params + self.unembed_params + self._idle_experts(rows)) * itemsize
        unquantized = self.num_layers * self.unquantized_params + self.unembed_params
        idle = self._idle_experts(rows) / self.expert_params * self.expert_bytes if self.expert_params else 0.0
        return self.num_layers * self.layer_bytes + unquantized * itemsize + idle

    @staticmethod
    def tokens(prompts: int, prompt_length: int, group: int, completion_length: int) -> int:
        """Tokens through the layers in one forward over a generation batch: B * P + B * G * C."""
        return prompts * prompt_length + prompts * group * completion_length

    def batch_forward(self, prompts: int, prompt_length: int, group: int, completion_length: int) -> float:
        """One forward over B prompts and their B * G completions, each prompt once (the module docstring)."""
        b, p, n, c = prompts, prompt_length, prompts * group, completion_length
        pairs = b * self.layer_pairs(0, p) + n * self.layer_pairs(p, c)
        return self._forward(self.tokens(b, p, group, c), n * c, pairs)

    def sampling(self, prompts: int, prompt_length: int, group: int, completion_length: int) -> float:
        """Prefill B prompts (logits at their last token) + C - 1 decode steps of B * G rows."""
        b, p, n, c = prompts, prompt_length, prompts * group, completion_length
        prefill = self._forward(b * p, b, b * self.layer_pairs(0, p))
        decode = self._forward(n * (c - 1), n * (c - 1), n * self.layer_pairs(p, c - 1))
        return prefill + decode

    def kv_cache_bytes(
        self, prompts: int, prompt_length: int, group: int, completion_length: int, itemsize: int
    ) -> int:
        """The sampler's caches: keys and values of every layer for B prompts (shared by their G rows) and
        B * G rows of C generated slots."""
        return (
            2
            * self.num_layers
            * self.kv_width
            * itemsize
            * (prompts * prompt_length + prompts * group * completion_length)
        )


def roofline_seconds(amounts: tuple[float, ...], rates: tuple[float, ...]) -> float:
    """The slowest resource: max over i of amounts[i] / rates[i] (e.g. FLOPs / peak FLOP/s, bytes / bytes/s);
    a rate that is NaN (not published) is left out; a NaN amount gives NaN.

    Example: roofline_seconds((4e12, 1e9), (2e12, 1e9)) = max(2.0, 1.0) = 2.0.
    """
    if any(math.isnan(a) for a in amounts):
        return math.nan
    return max(a / r for a, r in zip(amounts, rates, strict=True) if not math.isnan(r))


def rows_move(pairs: int, experts: int, hidden: int, itemsize: float) -> bool:
    """Whether a routed layer whose experts are split over fsdp along D should keep them there and move its rows
    (`moe.experts_apply`'s `contract`): where the psum of gate's and up's partial products of a data shard's
    `pairs` (T x K), pairs x 2F x 4 bytes, is smaller than the layer's experts, E x 3DF x `itemsize` (what
    gathering them moves; each device holds the same share of both; 4-bit codes about half a byte): pairs x 8 <
    3 E D x itemsize. A decode step's few rows: Qwen3-30B-A3B's 256 rows x 8 experts, 12.6 MB against 1.2 GB; a
    training micro-batch of 8 x 1,280 tokens a device on fsdp 8 (655k pairs, 4.0 GB) gathers the experts.
    Example: pairs 143, E 4, D 24, itemsize 4: 1,144 < 1,152 -> True; pairs 144: 1,152 -> False."""
    return pairs * 8 < 3 * experts * hidden * itemsize


def weights_stay(rows: int, din: int, dout: int, itemsize: float, side: int, n: int) -> bool:
    """Whether `rows` rows of a data shard should move to a weight [din, dout] split over n devices (fsdp) on `side`
    (0: din, 1: dout) rather than gather it, by the bytes a device receives ((n - 1) / n of each cancels): gathering
    the weight, din x dout x `itemsize`; moving the rows (`transformer.stationary_matmul`), on din: their hidden
    units exchanged (rows / n x din x itemsize) and the float32 partial sums reduce-scattered (rows x dout x 4); on
    dout: the rows gathered (rows x din x itemsize) and the float32 output columns exchanged (rows / n x dout x 4).
    Examples: 256 rows, [2880, 4096] in bf16 over 8 on din: 256 x (720 + 16,384) = 4.4M < 23.6M -> True; 64 rows,
    [64, 64] over 4 on din: 64 x (32 + 256) = 18,432 > 8,192 -> False."""
    if side == 0:
        return rows * (din * itemsize / n + dout * 4) < din * dout * itemsize
    return rows * (din * itemsize + dout * 4 / n) < din * dout * itemsize


def program_costs(assembly: Any, shapes: Any, chips: int, reward_model_configs: list[Any]
                  ) -> dict[str, tuple[float, float]]:
    """What the model needs of each program of a run, per chip: {program: (model FLOPs per call, the decode loop's
    floor in bytes per step (NaN: no decode loop))}, for the programs of `rloo_jax.build.Assembly.compile_set` over
    `chips` for `shapes` (width-suffixed names; update plans share their width's figure); `reward_model_configs`:
    the host reward models' `ModelConfig`s (compile-only's `rloo_jax.aot.compile_run` sets these figures against
    the compiler's)."""
    import jax

    cfg, prepared, scfg = assembly.cfg, assembly.prepared, assembly.programs.cfg
    model = Transformer.of(prepared.model.config, cfg.quant_spec)
    b, p, c, g = shapes.prompts, shapes.prompt_length, cfg.max_completion_length, cfg.num_generations
    itemsize = 2 if cfg.bf16 else 4  # the compute dtype: the sampler's matrices and KV caches
    sizes = {"data": 1, "fsdp": 1, "tensor": 1} if assembly.rollout_mesh is None else assembly.rollout_mesh.shape
    tensor, hidden = sizes["tensor"], prepared.model.config.hidden_size

    def decode_floor(prompts: int, group: int) -> float:
        """Per chip and decode step: every matrix its rows go through (FSDP gathers each layer whole, or a chip
        reads its share where the rows move to the matrix; the sampler's tensor parallelism splits them) and its
        share of the KV caches. A mixture of experts: of each routed block the min(E, rows x K) experts its rows
        can reach, the chip's share where they are split over the expert axis, and over fsdp too where the rows
        move to them (`rows_move`; quantized experts at their codes' and scales' bytes: each chip dequantizes its
        own slice)."""
        rows = prompts * group
        weights = model.weight_bytes(itemsize, rows)  # (a QLoRA base's codes at 4 or 8 bits)
        split = sizes.get("expert", 1)
        stored = itemsize if model.expert_bytes is None else model.expert_bytes / max(model.expert_params, 1)
        if (sizes["fsdp"] > 1 and model.routed_layers
                and rows_move(rows * model.experts_per_token // sizes["data"], model.num_experts, hidden, stored)):
            split *= sizes["fsdp"]
        weights -= model.expert_read_bytes(itemsize, rows) * (1 - 1 / split)
        # the sampler lays the LM head out V-split over fsdp (`sampling.rollout_weights`): each chip reads its
        # slice, the rows come to it. So do the blocks' other matrices (not stored 4-bit; split along D) where the
        # step's rows move to them (`mesh.stationary_side`), decided here for one D x D (each matrix has D on its
        # split side; a router's few columns may still be gathered: a few MB)
        n, vocab = sizes["fsdp"], model.unembed_params // hidden
        if n > 1 and vocab % n == 0:
            weights -= model.unembed_params * itemsize * (1 - 1 / n)
        if n > 1 and hidden % n == 0 and rows % (n * sizes["data"]) == 0 and weights_stay(
                rows // sizes["data"], hidden, hidden, itemsize, 0, n):
            weights -= model.split_bytes(itemsize) * (1 - 1 / n)
        return weights / tensor + model.kv_cache_bytes(prompts, p, group, c, itemsize) / chips

    # after sampling: the reference pass (beta > 0) and the old log-probs' training forward (recomputed); a value
    # model's and a device reward model's forwards (PPO)
    passes = scfg.algorithm.needs_reference + scfg.recompute
    heads = [dataclasses.replace(Transformer.of(m.config), unembed_params=m.config.hidden_size)  # D x 1 head
             for m in (prepared.value_model, prepared.device_reward_model) if m is not None]
    # forward + backward (activation and weight gradients: 3 forwards); with LoRA the frozen base has no weight
    # gradients (2 forwards) and the adapters, trained matrices of their own, 6 FLOPs per parameter and token
    adapter_params = sum(x.size for x in jax.tree.leaves(assembly.policy.params)) if cfg.use_peft else 0
    critic = heads[0] if prepared.value_model is not None else None

    def finish_flops(width: int) -> float:
        return passes * model.batch_forward(b, p, g, width) + sum(h.batch_forward(b, p, g, width) for h in heads)

    def update_flops(width: int) -> float:
        base = (2 if cfg.use_peft else 3) * model.batch_forward(b, p, g, width)
        if critic is not None:  # the value model: forward + backward, trained whole
            base += 3 * critic.batch_forward(b, p, g, width)
        return cfg.resolved_num_iterations * (base + 6.0 * adapter_params * model.tokens(b, p, g, width))

    costs = {"sample": (model.sampling(b, p, g, c) / chips, decode_floor(b, g))}
    for w in shapes.widths:
        at = "" if w == shapes.widths[0] else f"@{w}"
        costs[f"finish{at}"] = (finish_flops(w) / chips, math.nan)
        costs[f"update{at}"] = (update_flops(w) / chips, math.nan)
    if scfg.multi_turn:  # the prompts prefilled once and the C completion slots decoded or (tool results)
        # prefilled over the turns: what `sample` needs, counted at the first turn (compile-only's rollout line)
        costs["turns_start"] = costs["sample"]
    if shapes.eval_prompts:
        eb, ge = shapes.eval_prompts, cfg.resolved_num_generations_eval
        costs["eval_sample"] = (model.sampling(eb, p, ge, c) / chips, decode_floor(eb, ge))
        if scfg.multi_turn:
            costs["eval_turns_start"] = costs["eval_sample"]
        if prepared.device_reward_model is not None:
            costs["eval_scores"] = (heads[-1].batch_forward(eb, p, ge, c) / chips, math.nan)
    n = b * g
    width = -(-(p + c) // cfg.prompt_bucket) * cfg.prompt_bucket  # prompt + completion, as the texts are padded
    for i, rm_config in enumerate(reward_model_configs):
        t = Transformer.of(rm_config)  # its head: D x 1 at one position per row
        flops = forward_flops(t.layer_params, t.num_layers, rm_config.hidden_size, t.attention_width,
                              tokens=n * width, scored=n, pairs=n * causal_pairs(0, width, t.window))
        costs[f"reward_model_{i}"] = (flops / chips, math.nan)
    return costs
