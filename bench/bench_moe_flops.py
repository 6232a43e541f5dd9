"""Are a mixture of experts' matmuls sparse on a TPU? The TPU compiler's own FLOP counts (libtpu, no TPU needed:
`jax.experimental.topologies`) of one grouped matmul and of the routed MLP, forward and gradient, against the FLOPs
of the rows' own experts only.

    JAX_PLATFORMS=cpu python bench/bench_moe_flops.py

prints, per line, the compiler's FLOPs over the active ones: ~1 is sparse; a gradient of E + 1 (E experts) computes
every expert's weight gradient over every row. BENCHMARKS.md Session 18 has the figures.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import SingleDeviceSharding

from rloo_jax.models import moe
from rloo_jax.tpu import parse_slice, topology_devices

M, T, D, F, E = 1024, 512, 256, 128, 8  # grouped-matmul rows; routed-MLP tokens; hidden; expert width; experts


def compiler_flops(fn, *shapes) -> float:
    """The TPU compiler's FLOPs of `fn` jitted for one v5e chip, on abstract inputs of `shapes`."""
    device = topology_devices(parse_slice("v5e-1"))[0]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device)) for shape, dtype in shapes]
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


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
    """`moe.experts_apply` over T tokens, K experts each: active FLOPs 2 T K 3 D F forward, 3x with the gradient."""
    for k in (1, 2, 8):
        shapes = (((T, D), jnp.float32), ((T, k), jnp.int32), ((T, k), jnp.float32), ((E, D, F), jnp.float32),
                  ((E, D, F), jnp.float32), ((E, F, D), jnp.float32))

        def loss(x, experts, w, gate, up, down):
            return jnp.sum(moe.experts_apply(x, experts, w, gate, up, down))

        active = 2 * T * k * 3 * D * F
        forward = compiler_flops(loss, *shapes) / active
        gradient = compiler_flops(jax.grad(loss, argnums=(0, 3, 4, 5)), *shapes) / (3 * active)
        print(f"routed MLP, K {k} of {E}: forward {forward:.3f}, forward + gradient {gradient:.3f} (of 1x, 3x active)")


if __name__ == "__main__":
    grouped_matmul()
    routed_mlp()
