"""One layer's shared-prompt attention, forward + backward, compiled for one v5e chip: the einsum against two exact
splash formulations. Per chip 1 prompt of 256 tokens x G=8 completions of C tokens (Qwen2.5-1.5B's attention: 12
query heads, 2 kv heads, head dim 128, bf16). Compile-only (libtpu, no TPU):

    python bench/bench_attention.py [--completion 1024 8192] [--forms eager rows packed]

- eager: `attend` / `attend_shared_prompt` (float32 scores [heads, C, P + C] per completion).
- rows (what `attn_implementation splash` runs): the prompts' causal self-attention, and per completion row the keys
  [its prompt's (repeated G times); its own], its C queries causal with the offset P (stock `CausalMask`).
- packed: one kernel call per prompt over the packed row [P + G*C] with a block mask (completion g sees the prompt
  and its own block, causally): a custom splash mask (a `_ComputableMask` of ours), splash skipping empty blocks.

Prints per form: the compiler's temporaries, the HBM bytes (`rloo_jax.hlo`), the matmul TFLOPs with the kernels'
(blocks they visit), the kernel blocks visited, the seconds to trace + compile.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from rloo_jax import hlo  # noqa: E402
from rloo_jax.models import attention  # noqa: E402
from rloo_jax.tpu import parse_slice, quiet_stderr, topology_devices  # noqa: E402

B, G, P, H, K, DH = 1, 8, 256, 12, 2, 128


class PackedMask(sm._ComputableMask):  # noqa: SLF001 - splash's base for masks computed in the kernel
    """Causal within [prompt; completion g] of a packed row [P + G*C]: key k visible to query q iff k <= q and (k is
    a prompt token or q and k lie in the same completion)."""

    def __init__(self, shape: tuple[int, int], p: int, c: int) -> None:
        self.p, self.c = p, c

        def fn(q, k):  # noqa: ANN001, ANN202 - numpy at mask processing, jax inside the kernel
            # the kernel lowers `//` through `sign`, which needs a TPU to trace: integer division instead
            div = (lambda x: x // c) if isinstance(q, np.ndarray) else (lambda x: jax.lax.div(x, jnp.int32(c)))
            return (k <= q) & ((k < p) | (div(q + (c - p)) == div(k + (c - p))))

        super().__init__(shape=shape, mask_function=fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedMask) and (self.shape, self.p, self.c) == (other.shape, other.p, other.c)

    def __hash__(self) -> int:
        return hash((PackedMask, self.shape, self.p, self.c))


def packed_attention(q, k, v, seg, c):  # noqa: ANN001, ANN201
    """q [B, P + G*C, H, Dh], k/v [B, P + G*C, K, Dh], seg [B, P + G*C] -> [B, P + G*C, H, Dh]."""
    t = q.shape[1]
    blk = 256  # 512 does not divide P + G*C = 256 + 8 C
    qs = (q.astype(jnp.float32) * DH**-0.5).astype(q.dtype).transpose(0, 2, 1, 3)
    kern = sk.make_splash_mha(sm.MultiHeadMask([PackedMask((t, t), P, c)] * H), block_sizes=sk.BlockSizes(*(blk,) * 8),
                              head_shards=1, q_seq_shards=1)
    visited = 1 + G * sum(i + 2 for i in range(c // blk))  # the prompt's block; each completion block: prompt + causal
    with jax.named_scope(hlo.kernel_flops_scope(4 * B * H * DH * visited * blk * blk)):
        o = jax.vmap(kern)(qs, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                           segment_ids=sk.SegmentIds(q=seg, kv=seg))
    return o.transpose(0, 2, 1, 3), visited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--completion", nargs="+", type=int, default=[1024, 8192])
    ap.add_argument("--forms", nargs="+", default=["eager", "rows", "packed"], choices=["eager", "rows", "packed"])
    args = ap.parse_args()
    one = NamedSharding(Mesh(np.array(topology_devices(parse_slice("v5e-1"))), ("x",)), PartitionSpec())

    def arg(*shape, dtype=jnp.bfloat16):  # noqa: ANN002, ANN202
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    print("| C | form | temporaries GiB | HBM GB | TFLOP (kernels counted) | kernel blocks | trace + compile s |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for c in args.completion:
        visited = {}

        def loss(form, qp, qc, pk, pv, gk, gv, pmask, cmask, c=c, visited=visited):  # noqa: ANN001, ANN202
            if form == "packed":
                cat = lambda a, x: jnp.concatenate([a, x.reshape(B, G * c, *x.shape[2:])], axis=1)  # noqa: E731
                seg = jnp.concatenate([pmask, cmask.reshape(B, G * c)], axis=1)
                o, visited["packed"] = packed_attention(cat(qp, qc), cat(pk, gk), cat(pv, gv), seg, c)
                return jnp.sum(o.astype(jnp.float32))
            c_pos = jnp.repeat(pmask.sum(-1), G)[:, None] + jnp.cumsum(cmask, axis=-1) - 1
            fn = attention.shared_prompt(pmask, jnp.cumsum(pmask, -1), cmask, c_pos, dtype=jnp.bfloat16, window=None,
                                         implementation="eager" if form == "eager" else "splash")
            return sum(jnp.sum(o.astype(jnp.float32)) for o in fn(qp, qc, pk, pv, gk, gv))

        shapes = (arg(B, P, H, DH), arg(B * G, c, H, DH), arg(B, P, K, DH), arg(B, P, K, DH), arg(B * G, c, K, DH),
                  arg(B * G, c, K, DH), arg(B, P, dtype=jnp.int32), arg(B * G, c, dtype=jnp.int32))
        for form in args.forms:
            t0 = time.perf_counter()
            try:
                with quiet_stderr(), attention.compile_target("tpu"):
                    step = jax.jit(jax.grad(lambda *a, form=form: loss(form, *a), argnums=tuple(range(6))))
                    compiled = step.lower(*shapes).compile()
            except Exception as e:  # noqa: BLE001 - only "does not fit" is a result
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                print(f"| {c} | {form} | does not fit a v5e chip | | | | {time.perf_counter() - t0:.0f} |", flush=True)
                continue
            seconds = time.perf_counter() - t0
            cost = hlo.analyze(compiled.as_text()).total
            if form == "rows":
                bq, bkv, tp, sp = attention.splash_layout(c, P + c)
                from rloo_jax.efficiency import block_sparse_pairs

                per_row = block_sparse_pairs(tp, sp, bq, bkv, P) // (bq * bkv)
                blocks = f"{B * G} rows x {per_row} of {tp // bq * (sp // bkv)} ({bq} x {bkv}) + prompt"
            elif form == "packed":
                blocks = f"{visited['packed']} of {((P + G * c) // 256) ** 2} (256 x 256)"
            else:
                blocks = "-"
            print(f"| {c} | {form} | {compiled.memory_analysis().temp_size_in_bytes / 2**30:.3f} | "
                  f"{cost.hbm_bytes / 1e9:.2f} | {cost.flops / 1e12:.3f} | {blocks} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
