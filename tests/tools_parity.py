"""Whole-trainer parity with TRL 1.16's GRPOTrainer tool loop (DESIGN.md section 7, as tests/trainer_parity.py):
the demo's tool-calling policy (rloo_jax.demo_tools: a tiny Qwen3 SFT'd to call `add`, `multiply`, `divide`), the
same prompts, tools and rewards through `trl.GRPOTrainer(tools=...)` / `environment_factory=...` and through
`rloo_jax.GRPOTrainer`, greedy, compared record by record (the per-step metrics, `tools/*` included, the sampled
token ids, and the final weights).

The prompts make the greedy policy call a tool that succeeds (`add`), chain two rounds (`add` then `multiply`), call
an unknown tool (`power`), pass bad arguments (`multiply(x=...)`), raise (`divide` by 0), and call nothing (`say
hello`). G completions of a prompt are identical (greedy), so the reward also depends on the row's position in the
generation batch (tests/trainer_parity.py's `position_reward`) to give the update a gradient.
"""

from __future__ import annotations

import os
import random
from typing import Any

from rloo_jax import demo_tools
from tests.trainer_parity import METRICS as BASE_METRICS

G = 2
KINDS = ("add", "chain", "power", "divide", "say", "bad", "both", "add")
METRICS = (*BASE_METRICS, "tools/call_frequency", "tools/failure_frequency", "rewards/Calculator/mean")


def rows(num: int = 8, seed: int = 5) -> list[dict[str, Any]]:
    """Prompts of the demo's kinds with one-digit numbers (the SFT'd policy's greedy choices are wide there)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        kind = KINDS[i % len(KINDS)]
        out.append({"prompt": demo_tools.conversation(kind, rng.randint(2, 9), rng.randint(2, 9), rng)[:1]})
    return out


def position_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                    **kwargs: Any) -> list[float]:
    """Differs inside a group of identical completions (the row's position), and with the completion's tokens."""
    return [0.25 * (i % G) + 0.01 * len(ids) + 0.05 * (sum(ids) % 7) for i, ids in enumerate(completion_ids)]


class Calculator:
    """An environment: `add` and `divide` as its methods (bound, each rollout its own instance), counting its
    calls; `get_reward`: 0.1 per call made."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, **row: Any) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first term.
            b: The second term.
        """
        self.calls += 1
        return a + b

    def divide(self, a: int, b: int) -> float:
        """Divide two integers.

        Args:
            a: The dividend.
            b: The divisor.
        """
        self.calls += 1
        return a / b

    def get_reward(self) -> float:
        return 0.1 * self.calls


def _common(out: str, **options: Any) -> dict[str, Any]:
    base = dict(
        output_dir=out, per_device_train_batch_size=1, num_generations=G, max_completion_length=128, top_k=1,
        temperature=2.0, learning_rate=5e-3, max_steps=16, logging_steps=1, seed=0, shuffle_dataset=False,
        bf16=False, report_to="none", save_steps=1000, max_grad_norm=1.0, lr_scheduler_type="linear",
        steps_per_generation=8, gradient_accumulation_steps=1, beta=0.04,
    )
    base.update(options)
    return base


def _tools_and_env(environment: bool) -> dict[str, Any]:
    """`tools=[multiply, add, divide]`, or `tools=[multiply]` and the Calculator's add and divide (the same schemas in
    the same order: the prompts render alike)."""
    if environment:
        return {"tools": [demo_tools.multiply], "environment_factory": Calculator}
    return {"tools": list(demo_tools.TOOLS)}


def run_trl(model: str, out: str, environment: bool = False, **options: Any) -> dict[str, Any]:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer import grpo_trainer

    seen: list[list[int]] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return position_reward(prompts, completions, completion_ids)

    reward.__name__ = "position_reward"
    args = trl.GRPOConfig(**{**_common(out, **options), "report_to": []}, use_cpu=True)
    keep = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda d: d  # our order: the generation batch as generated
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    try:
        torch.manual_seed(0)
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.response_template = demo_tools.QWEN3_RESPONSE_TEMPLATE
        trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                  reward_funcs=[reward], args=args, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_list(rows()), **_tools_and_env(environment))
        trainer.train()
    finally:
        grpo_trainer.shuffle_sequence_dict = keep
    weights = {name: p.detach().numpy().copy() for name, p in trainer.model.named_parameters()}
    records = [r for r in trainer.state.log_history if "loss" in r]
    return {"records": records, "completions": seen, "weights": weights}


def run_ours(model: str, out: str, environment: bool = False, **options: Any) -> dict[str, Any]:
    import datasets
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    import rloo_jax as rj

    seen: list[list[int]] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return position_reward(prompts, completions, completion_ids)

    reward.__name__ = "position_reward"
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.response_template = demo_tools.QWEN3_RESPONSE_TEMPLATE
    trainer = rj.GRPOTrainer(model=model, reward_funcs=[reward], args=rj.GRPOConfig(**_common(out, **options)),
                             processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(rows()),
                             **_tools_and_env(environment))
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    weights = load_file(os.path.join(out, "final", "model.safetensors"))
    return {"records": records, "completions": seen, "weights": weights}
