"""TRL 1.16's `rollout_func` (rloo_jax/external.py): a user function builds each generation batch's completions in
the place of the sampler. Whole-trainer parity with TRL's GRPOTrainer given the same function (tests/trainer_parity.py:
the same tiny model, prompts and rewards; fixed completions derived from the prompt ids: varying lengths, an EOS
inside some, some ending in EOS, some truncated at max_completion_length, some not ending in EOS; zeros as log-probs;
an extra field read by the reward function; `env_mask` on one case), and the errors."""

import datasets
import numpy as np
import pytest

import rloo_jax as rj
from rloo_jax.errors import ConfigError, DataError
from tests import trainer_parity as tp

pytest.importorskip("trl")

pytestmark = [pytest.mark.parity]

STEPS = 4


def completion_of(prompt_ids, j):
    """Completion j of a prompt: 2..6 tokens derived from its ids; j = 1 holds an EOS inside (kept: no EOS cut),
    some end with EOS, the others stop without one (truncated)."""
    length = 2 + (sum(prompt_ids) + j) % 5
    ids = [(prompt_ids[k % len(prompt_ids)] + 3 * j + k) % 62 + 2 for k in range(length)]
    if j == 1:
        ids[1] = tp.EOS
    if (j + len(prompt_ids)) % 3 == 0:
        ids[-1] = tp.EOS
    return ids


def make_rollout_func(env_mask, calls):
    tok = tp.tokenizer()

    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        assert trainer is not None
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids = [completion_of(ids, i % tp.G) for i, ids in enumerate(prompt_ids)]
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
               "logprobs": [[0.0] * len(c) for c in completion_ids],
               "bonus": [0.3 * (i % 3) for i in range(len(prompts))], "scale": 2.0}
        if env_mask:
            out["env_mask"] = [[0 if k % 3 == 2 else 1 for k in range(len(c))] for c in completion_ids]
        return out

    return rollout_func


def reward(prompts, completions, completion_ids, bonus, scale, **kwargs):
    """`bonus` one value per completion, `scale` (not a list in rollout_func's output) the same for every one."""
    return [s * b + 0.1 * len(ids) + 0.05 * (sum(ids) % 7) + 0.02 * len(c)
            for s, b, ids, c in zip(scale, bonus, completion_ids, completions, strict=True)]


def run(side, model, out, env_mask, **options):
    calls = []
    args = dict(tp._common(out, max_steps=STEPS, learning_rate=2e-3), **options)
    data = datasets.Dataset.from_dict({"prompt": tp.PROMPTS})
    func = make_rollout_func(env_mask, calls)
    if side == "trl":
        import torch
        import trl
        from trl.trainer import grpo_trainer

        keep = grpo_trainer.shuffle_sequence_dict
        grpo_trainer.shuffle_sequence_dict = lambda d: d  # our order: the generation batch as returned
        try:
            torch.manual_seed(0)
            trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], processing_class=tp.tokenizer(),
                                      args=trl.GRPOConfig(**{**args, "report_to": []}, use_cpu=True),
                                      train_dataset=data, rollout_func=func)
            trainer.train()
        finally:
            grpo_trainer.shuffle_sequence_dict = keep
        weights = {name: p.detach().numpy().copy() for name, p in trainer.model.named_parameters()}
    else:
        from safetensors.numpy import load_file

        trainer = rj.GRPOTrainer(model=model, reward_funcs=[reward], processing_class=tp.tokenizer(),
                                 args=rj.GRPOConfig(**args), train_dataset=data, rollout_func=func)
        trainer.train()
        weights = load_file(f"{out}/final/model.safetensors")
    records = [r for r in trainer.state.log_history if "loss" in r]
    return {"records": records, "completions": calls, "weights": weights}


# off policy (steps_per_generation 4: old log-probs recomputed, the rollout's zeros as the sampler's), with a
# reference; on policy with env_mask (the external tokens out of the loss, the KL and the lengths) and the off-policy
# sequence mask, which reads the returned log-probs (zeros: far from the policy, so negative-advantage rows drop)
CASES = {
    "off_policy_beta": dict(env_mask=False, beta=0.04, loss_type="dapo"),
    "on_policy_env_mask": dict(env_mask=True, beta=0.04, loss_type="grpo", gradient_accumulation_steps=4,
                               mask_truncated_completions=True, off_policy_mask_threshold=0.5),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tp.build_model(str(tmp_path_factory.mktemp("rollout_func") / "m"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_rollout_func_equals_trl(case, model_dir, tmp_path):
    options = dict(CASES[case])
    env_mask = options.pop("env_mask")
    theirs = run("trl", model_dir, str(tmp_path / "trl"), env_mask, **options)
    ours = run("ours", model_dir, str(tmp_path / "ours"), env_mask, **options)
    assert theirs["completions"] == ours["completions"]  # the same prompts, G consecutive copies each
    assert all(len(batch) == 2 * tp.G for batch in ours["completions"])
    result = tp.compare(theirs, ours)
    assert result["steps"] == STEPS
    for name in ("loss", "kl", "reward", "completions/mean_length", "completions/max_length",
                 "completions/clipped_ratio"):
        assert name in result["metrics"], name
    for name, (abs_diff, rel_diff) in result["metrics"].items():
        assert abs_diff <= 1e-5 or rel_diff <= 1e-4, (name, abs_diff, rel_diff)
    assert result["weights"] <= 1e-4, result["weights"]
    assert all(r["grad_norm"] > 1e-3 for r in ours["records"])


# ------------------------------------------------------------------------------------------------ errors
def trainer_with(model_dir, tmp_path, func, **kwargs):
    return rj.GRPOTrainer(model=model_dir, reward_funcs=[reward], processing_class=tp.tokenizer(),
                          args=rj.GRPOConfig(**tp._common(str(tmp_path / "out"), max_steps=1)),
                          train_dataset=datasets.Dataset.from_dict({"prompt": tp.PROMPTS}), rollout_func=func,
                          **kwargs)


def broken(change):
    good = make_rollout_func(False, [])

    def func(prompts, trainer):
        out = good(prompts, trainer)
        change(out)
        return out

    return func


@pytest.mark.parametrize("change, error, match", [
    (lambda o: o.pop("logprobs"), ValueError, r"must return keys \['logprobs'\]"),
    (lambda o: o.update(completion_ids=o["completion_ids"][:-1]), DataError, "7 completion_ids for 8 completions"),
    (lambda o: o["prompt_ids"][1].append(5), DataError, "other prompt_ids for completion 1"),
    (lambda o: o["completion_ids"][2].extend([5] * 6), DataError, "raise max_completion_length"),
    (lambda o: o["logprobs"][0].append(0.0), DataError, "logprobs for completion 0"),
    (lambda o: o.update(bonus=[1.0]), DataError, "values of 'bonus'"),
])
def test_rollout_func_errors(change, error, match, model_dir, tmp_path):
    with pytest.raises(error, match=match):
        trainer_with(model_dir, tmp_path, broken(change)).train()


def test_rollout_func_prompt_longer_than_max_prompt_length(model_dir, tmp_path):
    trainer = rj.GRPOTrainer(model=model_dir, reward_funcs=[reward], processing_class=tp.tokenizer(),
                             args=rj.GRPOConfig(**tp._common(str(tmp_path / "out"), max_steps=1,
                                                             max_prompt_length=2)),
                             train_dataset=datasets.Dataset.from_dict({"prompt": tp.PROMPTS}),
                             rollout_func=make_rollout_func(False, []))
    with pytest.raises(DataError, match="more than max_prompt_length 2; raise max_prompt_length"):
        trainer.train()


def add(a, b):
    """Add two numbers.

    Args:
        a: first
        b: second
    """
    return a + b


def test_rollout_func_refused_with_tools(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="rollout_func with tools or environment_factory is not supported"):
        trainer_with(model_dir, tmp_path, make_rollout_func(False, []), tools=[add])
    with pytest.raises(ConfigError, match="rollout_func must be a callable"):
        trainer_with(model_dir, tmp_path, "not a function")
    with pytest.raises(ConfigError, match="rollout_func runs on one process here"):
        rj.GRPOTrainer(model=model_dir, reward_funcs=[reward], rollout_func=make_rollout_func(False, []),
                       args=rj.GRPOConfig(**tp._common(str(tmp_path / "out"), max_steps=1), num_processes=2),
                       train_dataset=datasets.Dataset.from_dict({"prompt": tp.PROMPTS}))


def test_completion_of_covers_the_cases():
    """The fixed completions hold what the parity runs must see: an EOS inside, EOS endings, truncations, lengths
    from 2 to max_completion_length."""
    tok = tp.tokenizer()
    comps = [completion_of(tok(p)["input_ids"], j) for p in tp.PROMPTS for j in range(tp.G)]
    ends = np.array([c[-1] == tp.EOS for c in comps])
    assert ends.any() and not ends.all()
    assert any(tp.EOS in c[:-1] for c in comps)
    assert {len(c) for c in comps} >= {2, tp.C}


def test_rloo_trainer_trains_and_evaluates_with_rollout_func(model_dir, tmp_path):
    """RLOOTrainer takes a rollout_func too; evaluation calls it as TRL does (each evaluation prompt
    num_generations_eval times), its metrics from the function's completions (lengths: every returned token)."""
    calls = []
    tok = tp.tokenizer()
    args = rj.RLOOConfig(**tp._common(str(tmp_path / "out"), max_steps=2, steps_per_generation=2, beta=0.05,
                                      eval_steps=2, per_device_eval_batch_size=4, num_generations_eval=2))
    trainer = rj.RLOOTrainer(model=model_dir, reward_funcs=[reward], processing_class=tok, args=args,
                             train_dataset=datasets.Dataset.from_dict({"prompt": tp.PROMPTS}),
                             eval_dataset=datasets.Dataset.from_dict({"prompt": tp.PROMPTS[:2]}),
                             rollout_func=make_rollout_func(False, calls))
    trainer.train()
    train_calls, eval_calls = calls[:-1], calls[-1:]
    assert train_calls == [[tp.PROMPTS[0]] * tp.G]  # one prompt per generation batch (2 x 2 completions)
    assert eval_calls == [[p for p in tp.PROMPTS[:2] for _ in range(2)]]
    lengths = [len(completion_of(tok(p)["input_ids"], i % tp.G)) for i, p in enumerate(eval_calls[0])]
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert len(evals) == 1 and evals[0]["eval_completions/mean_length"] == pytest.approx(np.mean(lengths))
    train_records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(train_records) == 2 and np.isfinite(train_records[-1]["loss"])
