"""PPO as a trainer (rloo_jax.PPOTrainer / `python -m rloo_jax.train ppo`): whole-trainer parity with TRL 1.12's
PPOTrainer (tests/ppo_parity.py), and the trainer's own contracts (bad inputs, exports)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests import ppo_parity as pp
from tests.fixtures_models import tiny_checkpoint  # noqa: F401

pytest.importorskip("torch")

# 2 updates of tiny float32 models, greedy: the harness's cases. Each covers the code paths TRL handles differently:
# `eos_minibatches`: stop at EOS (responses cut, padding_mask_p1's extra position, the score one past the EOS),
# missing_eos_penalty, 2 PPO epochs x 2 mini-batches (the optimizer stepping across mini-batch boundaries, zero-
# diluted statistics tables), k1. `no_stop_k3_whiten`: no stop token (full-length responses, EOS anywhere), k3,
# whitened rewards (8 rows per mini-batch), gamma and lam below 1.
CASES = {
    "eos_minibatches": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
                            num_ppo_epochs=2, stop_token="eos", missing_eos_penalty=1.0, kl_estimator="k1",
                            kl_coef=0.2, cliprange=0.1, cliprange_value=0.05, vf_coef=0.3),
    "no_stop_k3_whiten": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1,
                              num_ppo_epochs=1, kl_estimator="k3", whiten_rewards=True, kl_coef=0.1, gamma=0.97,
                              lam=0.9),
}
COMMON = dict(response_length=6, temperature=1.0, learning_rate=1e-3, seed=5)
# float32 on both sides: measured worst 4.8e-7 abs over every logged metric of both cases (objective/entropy; ratios
# and approxkl at the 1e-13 float floor), final weights 1.4e-5 apart (AdamW's first steps turn float noise in
# near-zero gradients into lr-sized moves)
TOLERANCE = dict(abs=1e-5, rel=1e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not (pp.TRL112 / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        pytest.skip(f"TRL 1.12 side folder {pp.TRL112} is absent: run `make install-test` (or `pip install --no-deps "
                    f"--target {pp.TRL112} trl==1.12.0`)")
    return pp.build_models(str(tmp_path_factory.mktemp("ppo_models")))


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ppo_trainer_equals_trl112(case, models, tmp_path):
    options = {**COMMON, **CASES[case]}
    theirs = pp.run_trl(models, str(tmp_path / "trl"), options)
    ours = pp.run_ours(models, str(tmp_path / "ours"), options)
    # the same completions (greedy on both sides)
    stop = pp.EOS if options.get("stop_token") == "eos" else None
    trl_texts = [t for batch in theirs["completions"] for t in pp.completion_texts(batch, stop)]
    our_texts = [r["completion"] for r in ours["rollouts"]]
    assert our_texts == trl_texts
    result = pp.compare(theirs, ours)
    for name, (abs_diff, rel_diff) in result["metrics"].items():
        assert abs_diff <= TOLERANCE["abs"] or rel_diff <= TOLERANCE["rel"], (name, abs_diff, rel_diff)
    assert result["weights"] <= 1e-4, result["weights"]
    assert os.path.isdir(tmp_path / "ours" / "final_value")


# ------------------------------------------------------------------------------------------------ resume, errors
# The demo task with PPO (the value model: the demo policy's backbone with a new score head), LoRA with dropout on the
# policy, shuffled mini-batches over 2 PPO epochs, a logging window spanning checkpoints, evaluation, rollout records.
PPO_RUN = [
    "ppo", "--max_steps", "8", "--save_steps", "2", "--logging_steps", "3", "--eval_steps", "5",
    "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "2",
    "--num_ppo_epochs", "2", "--per_device_eval_batch_size", "8", "--max_completion_length", "6",
    "--max_prompt_length", "5", "--log_completions", "true", "--learning_rate", "3e-3",
    "--use_peft", "--lora_target_modules", "all-linear", "--lora_dropout", "0.1", "--lora_r", "4",
    "--full_determinism", "true",
]  # fmt: skip


@pytest.mark.slow
def test_killed_ppo_runs_resume_bit_identical(tmp_path):
    """kill -9 anywhere (after a log, mid-save) and rerun: the same records, rollouts, policy adapters and value
    model as an uninterrupted run; a checkpoint holds the value model and its AdamW moments, no reward or frozen
    base weights."""
    from tests import test_reliability as rel

    cache = tmp_path / "cache"
    straight = rel.Launch(tmp_path / "straight", cache, tmp_path / "straight", PPO_RUN)
    assert straight.wait(timeout=600) == 0, straight.output()[1][-3000:]
    out = tmp_path / "run"
    for i, condition in enumerate([rel.logged(out, 3), rel.saving(out, 6)]):
        launch = rel.Launch(out, cache, tmp_path / f"log{i}", PPO_RUN)
        try:
            assert rel.wait_for(launch.proc, condition, timeout=600), f"run {i} ended before its kill point"
            launch.proc.send_signal(rel.signal.SIGKILL)
            assert launch.wait() == -rel.signal.SIGKILL
        finally:
            launch.close()
    last = rel.Launch(out, cache, tmp_path / "last", PPO_RUN)
    assert last.wait(timeout=600) == 0, last.output()[1][-3000:]
    assert "Resuming from checkpoint" in last.output()[0]
    for name in ("final/adapter_model.safetensors", "final_value/model.safetensors"):
        assert rel.sha256(out / name) == rel.sha256(tmp_path / "straight" / name), name
    records = rel.without_wall_time(rel.read_jsonl(out / "metrics.jsonl"))
    assert records == rel.without_wall_time(rel.read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    assert [r["step"] for r in records if "objective/kl" in r] == [3, 6, 8]
    assert rel.read_jsonl(out / "rollouts.jsonl") == rel.read_jsonl(tmp_path / "straight" / "rollouts.jsonl")
    listed = (out / "checkpoints" / "8" / "state" / "_METADATA").read_text()
    # (the reward model's field is listed as None: no weight under it)
    assert "'value_params', '" in listed and "lora_b" in listed and "'reward_params', '" not in listed


def test_value_model_of_another_tokenizer_exits_2(tmp_path, capsys):
    """A value model whose vocabulary is not the policy's: one line, exit 2, nothing written."""
    from rloo_jax import demo
    from rloo_jax.cli import main
    from rloo_jax.models import init_reward_model, save_pretrained

    other = dict(demo.MODEL_CONFIG, architectures=["Qwen2ForSequenceClassification"], vocab_size=64)
    save_pretrained(init_reward_model(other, seed=0), tmp_path / "value")
    argv = ["ppo", "--value_model_path", str(tmp_path / "value"), "--max_steps", "1",
            "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the value model at" in err[0] and "another vocabulary than the policy" in err[0], err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ compile-only
def test_compile_only_covers_ppo(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    """--compile_only on a PPO run: the rollout program holds the reference, old log-probs, value and reward model
    forwards, the update trains policy and value model; their weights count in what stays on the chips."""
    import json

    from rloo_jax.efficiency import Transformer
    from rloo_jax.models import config_from_hf
    from tests.test_compile_only import TINY_LLAMA, config_only_model, run_main

    tokenizer = tiny_checkpoint("tokenizer")
    (tmp_path / "p").mkdir()
    (tmp_path / "r").mkdir()
    policy = config_only_model(tmp_path / "p", TINY_LLAMA, tokenizer)
    reward = config_only_model(tmp_path / "r", dict(TINY_LLAMA, architectures=["LlamaForSequenceClassification"],
                                                    num_labels=1), tokenizer)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    code, out, err = run_main(capsys, [
        "ppo", "--model_name_or_path", str(policy), "--reward_model_path", str(reward), "--dataset_name", str(data),
        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
        "2", "--num_mini_batches", "2", "--num_ppo_epochs", "2", "--max_prompt_length", "16", "--prompt_bucket",
        "16", "--response_length", "32", "--compile_only", "--topology", "v5e-4", "--compilation_cache", "false",
        "--attn_implementation", "eager"])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    assert report["fits"] and set(report["programs"]) == {"rollout", "update"}
    s = report["settings"]
    assert (s["algorithm"], s["num_ppo_epochs"], s["num_mini_batches"], s["num_iterations"]) == ("ppo", 2, 2, 2)
    assert s["completions_per_generation"] == 2 * 2 * 4  # pdtbs x gradient_accumulation_steps x 4 data shards
    assert s["value_model_bytes_per_chip"] > 0 and s["reward_model_bytes_per_chip_on_device"] > 0
    # model FLOPs per chip: sampling + reference + old log-probs + value and reward heads (D x 1); the update:
    # 2 epochs x (policy + value model) forward + backward
    cfg = config_from_hf(TINY_LLAMA)
    lm = Transformer.of(cfg)
    head = dataclasses.replace(lm, unembed_params=cfg.hidden_size)
    b, p, c = 16, 16, 32
    rollout = lm.sampling(b, p, 1, c) + 2 * lm.batch_forward(b, p, 1, c) + 2 * head.batch_forward(b, p, 1, c)
    update = 2 * 3 * (lm.batch_forward(b, p, 1, c) + head.batch_forward(b, p, 1, c))
    programs = report["programs"]
    assert programs["rollout"]["model_flops"] == pytest.approx(rollout / 4)
    assert programs["update"]["model_flops"] == pytest.approx(update / 4)
    assert 1.0 < programs["update"]["flops_ratio"] < 1.6
    assert "FITS: every program fits v5e-4" in out


@pytest.mark.slow
def test_ppo_demo_learns(tmp_path):
    """`python -m rloo_jax.train ppo`, shortened: the score (the letters reward) of the last logged updates beats the
    first ones by far (measured: 0.05 -> 0.63 by update 60, 0.95 by 90)."""
    import numpy as np

    from rloo_jax.cli import main
    from rloo_jax.metrics import read_jsonl

    out = tmp_path / "learn"
    assert main(["ppo", "--output_dir", str(out), "--max_steps", "70", "--logging_steps", "5", "--eval_steps",
                 "None", "--save_steps", "1000"]) == 0
    scores = [m["objective/scores"] for m in read_jsonl(out / "metrics.jsonl") if "objective/scores" in m]
    assert len(scores) == 14
    assert np.mean(scores[:2]) < 0.1 and np.mean(scores[-2:]) > 0.4, scores
