"""rloo_jax: REINFORCE Leave-One-Out (TRL's RLOOTrainer math) as pure, jittable JAX functions."""

__version__ = "0.1.0"
