"""GRPO with the Python API, offline: the built-in demo policy (a tiny random-init Qwen2-shaped model) learns to spell
a prompt such as `ace:` as `ace`, scored by a plain Python reward function, as with TRL's `GRPOTrainer`.

    python examples/grpo_letters.py [--max_steps 200] [--output_dir runs/grpo_letters]

Swap in your own: `model="Qwen/Qwen2.5-0.5B-Instruct"` (a hub id, a folder or a loaded transformers model), a
`datasets.Dataset` with a `prompt` column (text or chat messages), and reward functions taking `completions` and
the dataset's other columns as keyword arguments.
"""

import argparse

from rloo_jax import GRPOConfig, GRPOTrainer
from rloo_jax.demo import make_rows


def letters_reward(completions: list[str], letters: list[str], **kwargs: object) -> list[float]:
    """1.0 for a completion that is exactly the prompt's letters, else the share of positions right."""
    rewards = []
    for completion, want in zip(completions, letters, strict=True):
        got = completion.strip()
        right = sum(a == b for a, b in zip(got, want, strict=False))
        rewards.append(1.0 if got == want else right / max(len(want), len(got), 1))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--output_dir", default="runs/grpo_letters")
    cli = parser.parse_args()
    train = make_rows(512, seed=0)  # {"prompt": "ace:", "letters": "ace"}, ...
    args = GRPOConfig(output_dir=cli.output_dir, max_steps=cli.max_steps, learning_rate=3e-3,
                      per_device_train_batch_size=64, num_generations=8, max_completion_length=8,
                      max_prompt_length=16, beta=0.0, logging_steps=10, save_steps=100)
    trainer = GRPOTrainer(model="demo", reward_funcs=letters_reward, args=args, train_dataset=train)
    result = trainer.train()
    last = [r for r in trainer.state.log_history if "reward" in r][-1]
    print(f"GRPO: {result.global_step} steps, last logged reward {last['reward']:.3f} (step {last['step']})")


if __name__ == "__main__":
    main()
