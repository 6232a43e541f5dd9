"""Quantized frozen weights for QLoRA: int8 per output channel, 4-bit NF4 / FP4 in blocks, dequantized on the fly.

A projection's kernel W [din, dout] (our layout: x W) is stored as integer codes and float32 scales and turned back
into the compute dtype inside the forward pass (`dequantize`), every time it is used: the sampler, the reference
pass and the update all read the codes; no full-precision copy of the base exists after loading.

- **int8** (`load_in_8bit`): per output channel, s_o = max_i |W[i, o]| / 127, codes round(W / s) in [-127, 127]
  (int8 [din, dout]), scales [1, dout]. bitsandbytes' Int8 weight format (its row-wise absmax of the torch
  [out, in] weight). LLM.int8()'s outlier split is a trick of its int8 x int8 matmul; here the weight is dequantized
  and multiplied in the compute dtype, so the activations are never quantized.
- **4-bit** (`load_in_4bit`): blocks of K consecutive input rows of one output column (K = 64, or gcd(din, 64)), each
  with its absmax s; a weight is the nearest value of a 16-entry codebook c (normalised to [-1, 1]) times s:
  W ~ c[code] * s. `nf4`: the NormalFloat4 codebook of QLoRA (Dettmers et al. 2023, appendix E; bitsandbytes'
  values and code order); `fp4`: bitsandbytes' FP4 (e2m1-like: +-{0, 1/192, 1/6, 1/4, 1/3, 1/2, 2/3, 1}). These are
  bitsandbytes' blocks too: it flattens the torch [out, in] weight into runs of 64, i.e. 64 inputs of one output.
  Codes are `jnp.uint4` [K, din/K, dout] (4 bits each in TPU memory: the compiler packs them two to a byte),
  scales float32 [1, din/K, dout]: code [k, b, o] is weight W[b * K + k, o]. The weight is never reshaped, so the
  dequantization fuses into the matmul (`blocked_matmul`: the TPU compiler reads the 4-bit codes from HBM and
  never writes the bf16 weight back; BENCHMARKS.md, Session 7), and K leads because that is the layout the TPU
  compiler gives the codes in the decode loop: stored [din/K, K, dout], each loop began with a relayouted copy of
  the whole stacked base, 4.9 GB per chip of Llama-3.1-70B on a v5e-8, twice in the rollout (BENCHMARKS.md,
  Session 9). Products over many positions (prefill, log-prob and training forwards) want [din/K, K, dout]; the
  model relayouts one gathered layer at a time for them (`transformer._codes`, Session 11).
- **double quantization** (`use_bnb_nested_quant`, bitsandbytes' bnb_4bit_use_double_quant): the 4-bit scales
  themselves as uint8 codes of a float32 scale per group of g = gcd(dout, 256) consecutive output columns:
  s ~ code8 * s2, s2 = max(s) / 255 over the group. 4 -> 1 byte per 64 weights (+ 4 per 64 x 256).

Codes are computed against the scale as stored (after double quantization), so each weight is the nearest value
its block can represent; a tie (exactly between two codebook values) goes to the smaller. All-zero blocks and
columns get scale 0 and dequantize to 0.

Shapes: leading axes (e.g. the stacked layers [L, ...]) pass through every function.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FP4", "KINDS", "NF4", "QuantSpec", "block_size", "blocked_matmul", "dequantize", "lookup", "quantize",
           "stored_bytes", "unblock"]

KINDS = ("int8", "nf4", "fp4")
BLOCK = 64  # 4-bit: input rows per scale (bitsandbytes' blocksize)
GROUP = 256  # double quantization: scales per second-level scale (bitsandbytes' nested blocksize)
# QLoRA's NormalFloat4 (bitsandbytes `dDequantizeNF4`, in its code order 0b0000 .. 0b1111): quantiles of N(0, 1)
# normalised to [-1, 1] with an exact zero
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# bitsandbytes' FP4 (`dDequantizeFP4Tree`): sign bit + these 8 magnitudes (its 0b0001 is 1/192, not e2m1's 1/12),
# sorted here (our code order; bitsandbytes' bit patterns differ, the values do not)
_FP4_POS = (0.0, 0.005208333333333333, 0.16666666666666666, 0.25, 0.3333333333333333, 0.5, 0.6666666666666666, 1.0)
FP4 = tuple(-x for x in reversed(_FP4_POS)) + _FP4_POS


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a frozen base's block projections are stored: `kind` int8 | nf4 | fp4, `double_quant` (4-bit only)."""

    kind: str
    double_quant: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quantization {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.double_quant and self.kind == "int8":
            raise ValueError("double quantization applies to the 4-bit scales (nf4, fp4), not int8")

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4


def block_size(din: int) -> int:
    """Input rows per 4-bit scale: gcd(din, 64) (64 for every hidden and MLP width of the supported checkpoints).
    Example: 4096 -> 64, 896 -> 64, 32 -> 32, 100 -> 4."""
    return math.gcd(din, BLOCK)


def group_size(dout: int) -> int:
    """Scales per second-level scale (double quantization), along the output axis: gcd(dout, 256).
    Example: 4096 -> 256, 128 -> 128."""
    return math.gcd(dout, GROUP)


def codebook(kind: str) -> np.ndarray:
    """The 16 values a 4-bit code stands for, float32, ascending (code i -> value i)."""
    return np.asarray(NF4 if kind == "nf4" else FP4, np.float32)


def nearest_code(x: jax.Array, table: np.ndarray) -> jax.Array:
    """Index of the nearest entry of an ascending `table` for each x (ties to the smaller): the number of midpoints
    between neighbours that lie below x. Example: table [-1, 0, 1], x [-0.6, 0.5, 0.7] -> [0, 1, 2]."""
    mids = jnp.asarray((table[1:] + table[:-1]) / 2, jnp.float32)
    return jnp.searchsorted(mids, x.astype(jnp.float32), side="left")


def _double_quantize(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """scale [..., 1, n, dout] (>= 0) -> (uint8 codes [..., 1, n, dout], float32 s2 [..., 1, n, dout / g]) with
    scale ~ code * s2, s2 = max over each group of g = `group_size(dout)` columns / 255; a nonzero scale never
    rounds to code 0. Example (g = 2): [[[2.0, 1.0]]] -> codes [[[255, 128]]], s2 [[[2/255]]]."""
    *lead, dout = scale.shape
    g = group_size(dout)
    groups = scale.reshape(*lead, dout // g, g)
    s2 = jnp.max(groups, axis=-1) * np.float32(1 / 255)  # (a product: eager and jitted code round it alike)
    code = jnp.round(groups / jnp.where(s2 > 0, s2, 1.0)[..., None])
    code = jnp.where(groups > 0, jnp.clip(code, 1, 255), 0)
    return code.reshape(scale.shape).astype(jnp.uint8), s2


def _scales(q: dict[str, jax.Array]) -> jax.Array:
    """The float32 scales of stored codes: `scale`, or `scale` (uint8) x its group's `scale2`."""
    if "scale2" not in q:
        return q["scale"].astype(jnp.float32)
    s2 = q["scale2"]
    g = q["scale"].shape[-1] // s2.shape[-1]
    return q["scale"].astype(jnp.float32) * jnp.repeat(s2, g, axis=-1)


def quantize(w: jax.Array, spec: QuantSpec) -> dict[str, jax.Array]:
    """A kernel [..., din, dout] -> its stored arrays: {"codes", "scale"} (+ "scale2" with double quantization).

    int8: codes int8 [..., din, dout] = round(w / s), s float32 [..., 1, dout] = absmax over din / 127.
    4-bit: codes uint4 [..., K, din/K, dout] = nearest codebook index of w / s (code [k, b, o] for w[b * K + k,
    o]), s float32 [..., 1, din/K, dout] = the block's absmax (uint8 + float32 scale2 with double quantization).
    Example (int8): w [[1.0], [-0.5]] -> codes [[127], [-64]], scale [[1/127]] (w / s = -63.5 rounds to even,
    -64).
    """
    w = w.astype(jnp.float32)
    *lead, din, dout = w.shape
    if spec.kind == "int8":
        scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.0
        codes = jnp.clip(jnp.round(w / jnp.where(scale > 0, scale, 1.0)), -127, 127)
        return {"codes": codes.astype(jnp.int8), "scale": scale}
    k = block_size(din)
    blocks = jnp.swapaxes(w.reshape(*lead, din // k, k, dout), -3, -2)  # [..., K, din/K, dout]
    out = {"scale": jnp.max(jnp.abs(blocks), axis=-3, keepdims=True)}  # [..., 1, din/K, dout]
    if spec.double_quant:
        out["scale"], out["scale2"] = _double_quantize(out["scale"])
    scale = _scales(out)
    out["codes"] = nearest_code(blocks / jnp.where(scale > 0, scale, 1.0), codebook(spec.kind)).astype(jnp.uint4)
    return out


def dequantize(q: dict[str, jax.Array], spec: QuantSpec, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The stored arrays of `quantize` -> the weight in `dtype`, computed in float32 and rounded once: int8
    [..., din, dout] = codes * s; 4-bit [..., K, din/K, dout] (blocked: `blocked_matmul` takes it as is,
    `unblock` gives the kernel) = codebook[codes] * s."""
    scale = _scales(q)
    if spec.kind == "int8":
        return (q["codes"].astype(jnp.float32) * scale).astype(dtype)
    return (lookup(q["codes"], codebook(spec.kind)) * scale).astype(dtype)


def lookup(codes: jax.Array, table: np.ndarray) -> jax.Array:
    """table[codes] for 4-bit codes, float32, as a tree of selects on the code's bits (15 per value): elementwise,
    so the TPU compiler fuses it into the matmul that reads the codes. `jnp.take` lowers to a gather, which it
    ran as a separate kernel writing the float32 values to HBM: 36x the bytes of a decode step's floor on
    Llama-3.1-8B's shapes (BENCHMARKS.md). Example: codes [0, 5, 15] of NF4 -> [-1.0, -0.1848, 1.0]."""
    code = codes.astype(jnp.uint8)
    level = [jnp.float32(v) for v in table]
    for bit in range(4):
        on = (code >> bit) & 1 == 1
        level = [jnp.where(on, level[i + 1], level[i]) for i in range(0, len(level), 2)]
    return level[0]


def unblock(w: jax.Array) -> jax.Array:
    """A blocked 4-bit weight [..., K, din/K, dout] (`dequantize`) -> the kernel [..., din, dout]: row b * K + k is
    w[k, b]. Example: K 2, w[:, :, 0] = [[1, 3], [2, 4]] -> kernel column [1, 2, 3, 4]."""
    *lead, k, nb, dout = w.shape
    return jnp.swapaxes(w, -3, -2).reshape(*lead, nb * k, dout)


def blocked_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [N, din] @ w, w a kernel [din, dout] or blocked [K, din/K, dout] (4-bit, `dequantize`), accumulated in
    float32: [N, dout] float32. The blocked form contracts both of its leading axes, so the weight is never
    reshaped: a reshape between the dequantization and the dot kept the TPU compiler from fusing them (it wrote the
    bf16 weight to HBM and read it back: 292 against 38 MiB per 8192 x 8192 matrix and call, BENCHMARKS.md)."""
    if w.ndim == 2:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    k, nb, _ = w.shape
    return jnp.einsum("nbk,kbo->no", x.reshape(x.shape[0], nb, k), w, preferred_element_type=jnp.float32)


def stored_axes(axes: tuple, spec: QuantSpec) -> dict[str, tuple]:
    """Logical axes of the stored arrays of a kernel with logical axes (in, out) (e.g. ("embed", "mlp")): the
    block axis takes the input's name (it splits as the rows did), K and the singleton axes none."""
    a_in, a_out = axes
    if spec.kind == "int8":
        return {"codes": (a_in, a_out), "scale": (None, a_out)}
    out = {"codes": (None, a_in, a_out), "scale": (None, a_in, a_out)}
    return out | ({"scale2": (None, a_in, a_out)} if spec.double_quant else {})


def stored_bytes(din: int, dout: int, spec: QuantSpec | None, itemsize: int = 2) -> float:
    """Bytes one [din, dout] kernel occupies as stored: codes at `spec.bits` bits + scales (float32, or uint8 +
    float32 per group with double quantization); without `spec`, din * dout * itemsize.

    Example: 4096 x 4096 nf4: 8 MiB of codes + 64 x 4096 x 4 B of scales = 8.39e6 + 1.05e6 = 9437184.
    """
    if spec is None:
        return float(din * dout * itemsize)
    codes = din * dout * spec.bits / 8
    if spec.kind == "int8":
        return codes + 4.0 * dout
    blocks = din // block_size(din) * dout
    scales = blocks + 4.0 * blocks / group_size(dout) if spec.double_quant else 4.0 * blocks
    return codes + scales
