"""PPO with a value model through the Python API, offline, as TRL 1.12's `PPOTrainer` runs it: the built-in demo
policy learns to spell a prompt such as `ace:` as `ace`. The value model starts from the policy's own checkpoint
(its backbone with a new scalar head, as `AutoModelForSequenceClassification.from_pretrained` of a causal LM gives);
a Python reward function stands in for TRL's reward model (`reward_funcs`, not in TRL: with `reward_model=` too,
the score is their weighted sum).

    python examples/ppo_letters.py [--max_steps 100] [--output_dir runs/ppo_letters]

TRL's TL;DR recipe (a reward model, pre-tokenized prompts) is docs/ppo.md's first example.
"""

import argparse

from grpo_letters import letters_reward

from rloo_jax import PPOConfig, PPOTrainer
from rloo_jax.demo import make_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--output_dir", default="runs/ppo_letters")
    cli = parser.parse_args()
    train = make_rows(512, seed=0)
    args = PPOConfig(output_dir=cli.output_dir, max_steps=cli.max_steps, learning_rate=3e-3,
                     per_device_train_batch_size=16, gradient_accumulation_steps=2, num_ppo_epochs=2,
                     num_mini_batches=2, max_completion_length=8, max_prompt_length=16, logging_steps=10,
                     save_steps=50)
    trainer = PPOTrainer(args=args, model="demo", value_model="demo", reward_funcs=[letters_reward],
                         train_dataset=train)
    result = trainer.train()
    last = [r for r in trainer.state.log_history if "objective/scores" in r][-1]  # TRL 1.12's PPO metric names
    print(f"PPO: {result.global_step} steps, last logged score {last['objective/scores']:.3f} (step {last['step']})")


if __name__ == "__main__":
    main()
