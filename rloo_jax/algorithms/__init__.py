"""What makes RLOO, GRPO and PPO different, as pure functions; the step (``rloo_jax.step``) composes them.

An algorithm is a small frozen value (``RLOO(...)``, ``GRPO(...)``) holding its knobs under TRL's names, with:

- ``score(ScoreInputs) -> (targets, metrics)``: generation time, once per generation batch: rewards (and the
  behaviour / reference log-probs) -> per-row targets the update reads, ``{"advantages": [N]}`` (or ``[N, C]``);
- ``loss(LossInputs) -> (loss, metrics, stats)``: one micro-batch of an optimizer step, differentiated by the
  update; ``stats`` are summed over the step's micro-batches and handed to ``next_state``;
- ``init_state() -> state`` and ``next_state(state, stats) -> (state, step_metrics)``: what the algorithm carries
  from one optimizer step to the next in the train state (GRPO's adaptive entropy coefficient; None for RLOO);
  optionally ``init_stats()``: zero ``stats`` (their structure), for a step begun in one generation batch and
  completed in the next (default: no statistics);
- ``record_advantages(advantages, mask) -> [N]``: on the host, a completion's advantage as the rollout records
  show it (PPO: the mean of its tokens');
- ``summarize(metrics) -> metrics``: once per generation batch, inside the update program, the update's metrics
  (``{"generation", "micro" [U, M], "update" [U]}``) as the algorithm logs them (PPO: TRL 1.12's per-update record;
  RLOO, GRPO: unchanged);
- ``needs_reference`` (reference log-probs at generation time), ``needs_values`` (a value model: its estimates at
  generation time in ``ScoreInputs.values``, the current ones, with their gradient, in ``LossInputs.values``),
  ``entropy_grad`` (the loss differentiates the entropy), ``mask_truncated_completions``, ``step_unit``
  (``"optimizer"``: a step is an optimizer step, TRL's Trainer; ``"generation"``: a step is one update over a
  generation batch, TRL 1.12's PPO).

The step holds no algorithm name: the same rollout and update programs run any value with this interface.
"""

from typing import Any, Protocol

import jax
import numpy as np

from rloo_jax.algorithms.common import LossInputs, ScoreInputs
from rloo_jax.algorithms.grpo import GRPO
from rloo_jax.algorithms.grpo_config import GRPOConfig
from rloo_jax.algorithms.ppo import PPO
from rloo_jax.algorithms.ppo_config import PPOConfig
from rloo_jax.algorithms.rloo import RLOO, RLOOOptions
from rloo_jax.algorithms.rloo_config import RLOOConfig
from rloo_jax.config import TrainConfig

# The algorithms a command line, a config file and a checkpoint name (`ALGORITHM`): one line each. The trainers'
# registry is `rloo_jax.trainers.TRAINERS`.
CONFIGS: dict[str, type[TrainConfig]] = {cls.ALGORITHM: cls for cls in (
    RLOOConfig,
    GRPOConfig,
    PPOConfig,
)}
DEFAULT = RLOOConfig.ALGORITHM  # what a command line or config file naming none runs (and older checkpoints hold)


class Algorithm(Protocol):
    """The interface the step composes (see the module docstring)."""

    needs_values: bool
    mask_truncated_completions: bool
    step_unit: str

    @property
    def needs_reference(self) -> bool: ...

    @property
    def entropy_grad(self) -> bool: ...

    def score(self, batch: ScoreInputs) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]: ...

    def loss(self, batch: LossInputs) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]: ...

    def init_state(self) -> Any: ...

    def next_state(self, state: Any, stats: dict[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]: ...

    def summarize(self, metrics: dict[str, dict[str, jax.Array]]) -> dict[str, dict[str, jax.Array]]: ...

    def record_advantages(self, advantages: np.ndarray, mask: np.ndarray) -> np.ndarray: ...


__all__ = ["CONFIGS", "DEFAULT", "GRPO", "PPO", "RLOO", "Algorithm", "GRPOConfig", "LossInputs", "PPOConfig",
           "RLOOConfig", "RLOOOptions", "ScoreInputs"]
