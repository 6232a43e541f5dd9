"""Are a mixture of experts' matmuls sparse on a TPU? The TPU compiler's own FLOP counts (libtpu, no TPU needed:
`jax.experimental.topologies`) of one grouped matmul and of the routed MLP (`moe.experts_apply` by each
`moe_implementation`), forward and gradient, against the FLOPs of the rows' own experts only.

    JAX_PLATFORMS=cpu python bench/bench_moe_flops.py

prints, per line, the compiler's FLOPs over the active ones: ~1 is sparse; a gradient of E + 1 (E experts) computes
every expert's weight gradient over every row. For the routed MLP two counts: XLA's `cost_analysis()` (a Pallas
kernel counts its own cost estimate: megablox's 2 M K N of its padded rows) and `rloo_jax.hlo` (what `--compile_only`
reports as x model: megablox's bound, each group's rows in whole row tiles). BENCHMARKS.md Sessions 18-19.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's rloo_jax, whatever is installed

from rloo_jax import hlo  # noqa: E402
from rloo_jax.models import moe  # noqa: E402
from rloo_jax.models.attention import compile_target  # noqa: E402
from rloo_jax.tpu import parse_slice, topology_devices  # noqa: E402

M, T, D, F, E = 1024, 512, 256, 128, 8  # grouped-matmul rows; routed-MLP tokens; hidden; expert width; experts
# the routed MLPs measured: (tokens T, experts E, K values); the last one Qwen3-30B-A3B's routing (128 experts, 8 a
# token) over a micro-batch of 8 x 1,024 tokens
ROUTED = ((T, E, (1, 2, 8)), (8192, 128, (8,)))


def compiled(fn, *shapes) -> jax.stages.Compiled:
    """`fn` jitted for one v5e chip, on abstract inputs of `shapes` (Pallas kernels lowered for Mosaic)."""
    device = topology_devices(parse_slice("v5e-1"))[0]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device)) for shape, dtype in shapes]
    with compile_target("tpu"):
        return jax.jit(fn).lower(*args).compile()


def compiler_flops(fn, *shapes) -> float:
    """The TPU compiler's FLOPs (`cost_analysis`) of `fn` for one v5e chip, on abstract inputs of `shapes`."""
    cost = compiled(fn, *shapes).cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def counted_flops(fn, *shapes) -> tuple[float, float]:
    """(`cost_analysis`'s FLOPs, `rloo_jax.hlo`'s) of `fn` for one v5e chip."""
    program = compiled(fn, *shapes)
    cost = program.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"], hlo.analyze(program.as_text()).total.flops


def grouped_matmul() -> None:
    """[M, D] rows in E groups times [E, D, F]: active FLOPs 2 M D F (forward), twice that (input and weight
    gradients)."""
    shapes = (((M, D), jnp.bfloat16), ((E, D, F), jnp.bfloat16), ((E,), jnp.int32))
    ops = {
        "ragged_dot": lambda x, w, s: jnp.sum(jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32)),
        "megablox gmm": lambda x, w, s: jnp.sum(megablox.gmm(x, w, s, jnp.float32, (128, 128, 128))),
    }
    active = 2 * M * D * F
    for name, fn in ops.items():
        forward = compiler_flops(fn, *shapes) / active
        gradient = compiler_flops(jax.grad(fn, argnums=(0, 1)), *shapes) / (2 * active)
        print(f"grouped matmul, {name:12s}: forward {forward:.3f}, gradient {gradient:.3f} (of the active FLOPs)")


def routed_mlp() -> None:
    """`moe.experts_apply` over t tokens, k of e experts each (`ROUTED`), by each implementation: active FLOPs
    2 t k 3 D F forward, 3x with the gradient."""
    for t, e, ks in ROUTED:
        for k in ks:
            for implementation in moe.IMPLEMENTATIONS:
                shapes = (((t, D), jnp.float32), ((t, k), jnp.int32), ((t, k), jnp.float32),
                          ((e, D, F), jnp.float32), ((e, D, F), jnp.float32), ((e, F, D), jnp.float32))

                def loss(x, experts, w, gate, up, down, implementation=implementation):
                    return jnp.sum(moe.experts_apply(x, experts, w, gate, up, down, jnp.bfloat16,
                                                     implementation=implementation))

                active = 2 * t * k * 3 * D * F
                forward = [f / active for f in counted_flops(loss, *shapes)]
                gradient = [f / (3 * active) for f in counted_flops(jax.grad(loss, argnums=(0, 3, 4, 5)), *shapes)]
                print(f"routed MLP, T {t}, K {k} of {e}, {implementation:10s}: forward {forward[0]:.3f} "
                      f"(hlo {forward[1]:.3f}), forward + gradient {gradient[0]:.3f} (hlo {gradient[1]:.3f}) "
                      f"(of 1x, 3x active)", flush=True)


if __name__ == "__main__":
    grouped_matmul()
    routed_mlp()
