"""The training loop end to end on the built-in demo: outputs, resume, failures, shipped configs, learning."""

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rloo_jax import demo
from rloo_jax.backend import visible_accelerator
from rloo_jax.cli import main
from rloo_jax.completions import completion_lengths
from rloo_jax.loop import crossed
from rloo_jax.metrics import read_jsonl
from rloo_jax.models.hf import eos_token_ids
from rloo_jax.optimizer import lr_schedule
from tests.xla_flags import cli_at_xla_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the demo, shrunk: 8 prompts x G=4 per step, 8-token completions
SMALL = [
    "--per_device_train_batch_size",
    "32",
    "--num_generations",
    "4",
    "--max_completion_length",
    "8",
    "--eval_steps",
    "None",
    "--compilation_cache",
    "false",
    # a dense reward: the default demo's echo_reward is 0 for nearly every completion of a random policy
    "--reward_funcs",
    "rloo_jax.demo:letters_reward",
]
REQUIRED = [
    "step",
    "reward",
    "reward_std",
    "rewards/echo_reward/mean",
    "rewards/echo_reward/std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "step_time",
    "learning_rate",
    "kl",
    "entropy",
    "loss",
    "grad_norm",
    "frac_reward_zero_std",
    "num_tokens",
]


def steps_of(path):
    return [r["step"] for r in read_jsonl(path) if "reward" in r]


# ------------------------------------------------------------------------------------------------ helpers
def test_lr_schedule_goldens():
    lin = lr_schedule("linear", 1.0, 2, 6)
    np.testing.assert_allclose([float(lin(s)) for s in range(6)], [0, 0.5, 1, 0.75, 0.5, 0.25])
    cos = lr_schedule("cosine", 2.0, 0, 4)
    np.testing.assert_allclose([float(cos(s)) for s in range(5)], [2, 1 + 2**-0.5, 1, 1 - 2**-0.5, 0], atol=1e-6)
    np.testing.assert_allclose(
        [float(lr_schedule("constant_with_warmup", 1.0, 2, 9)(s)) for s in range(4)], [0, 0.5, 1, 1]
    )
    assert float(lr_schedule("constant", 0.1, 5, 9)(0)) == pytest.approx(0.1)
    # cosine_with_min_lr, lr 2, W 1, T 5, floor 0.1 of lr: 2 * (0.1 + 0.9 * (1 + cos(pi * p)) / 2), p = (s - 1) / 4
    floor = lr_schedule("cosine_with_min_lr", 2.0, 1, 5, min_lr_rate=0.1)
    halfway = [2 * (0.1 + 0.45 * (1 + 2**-0.5)), 1.1, 2 * (0.1 + 0.45 * (1 - 2**-0.5))]
    np.testing.assert_allclose([float(floor(s)) for s in range(7)], [0, 2, *halfway, 0.2, 0.2], rtol=1e-6)


def test_cosine_with_min_lr_equals_transformers():
    """Our schedule against transformers' own (the LambdaLR a TRL run steps), min_lr and min_lr_rate alike, from the
    options as a TRL config names them (lr_scheduler_kwargs)."""
    import torch
    from transformers import get_scheduler

    from rloo_jax.algorithms import RLOOConfig
    from rloo_jax.optimizer import min_lr_rate, warmup_steps

    for kwargs in ({"min_lr": 3e-7}, {"min_lr_rate": 0.25, "num_cycles": 0.5}):
        cfg = RLOOConfig(output_dir="o", learning_rate=1e-6, lr_scheduler_type="cosine_with_min_lr", warmup_steps=3,
                         lr_scheduler_kwargs=kwargs)
        ours = lr_schedule(cfg.lr_scheduler_type, cfg.learning_rate, warmup_steps(cfg, 20), 20, min_lr_rate(cfg))
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
        theirs = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=3, num_training_steps=20,
                               scheduler_specific_kwargs=kwargs)
        want = []
        for _ in range(20):
            want.append(opt.param_groups[0]["lr"])
            opt.step()
            theirs.step()
        np.testing.assert_allclose([float(ours(s)) for s in range(20)], want, rtol=1e-6, atol=0)


def test_completion_lengths_crossed_and_eos_ids(tmp_path):
    ids = np.array([[5, 1, 0], [5, 6, 7], [2, 9, 9]])
    np.testing.assert_array_equal(completion_lengths(ids, (1, 2)), [2, 3, 1])
    assert crossed(9, 10, 5) and not crossed(10, 14, 5) and crossed(3, 7, 5) and not crossed(1, 2, None)
    tok = demo.build_tokenizer()
    assert eos_token_ids(str(tmp_path), tok) == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    assert eos_token_ids(str(tmp_path), tok) == (1, 7)


def test_transformers_torch_notice_is_dropped_and_nothing_else(caplog):
    import logging

    import rloo_jax  # noqa: F401 -- installs the filter

    log = logging.getLogger("transformers")
    with caplog.at_level(logging.WARNING, logger="transformers"):
        log.warning("PyTorch was not found. Models won't be available and only tokenizers, configuration and "
                    "file/data utilities can be used.")
        log.warning("something else")
        log.error("PyTorch was not found: an error")  # errors are never dropped
        logging.getLogger("transformers.models").warning("PyTorch was not found, said a submodule")
    assert [r.getMessage() for r in caplog.records] == [
        "something else", "PyTorch was not found: an error", "PyTorch was not found, said a submodule"]


# ------------------------------------------------------------------------------------------------ end to end
def test_python_api_on_a_machine_without_an_accelerator_is_quiet():
    """`import rloo_jax` (scripts, notebooks) picks the CPU as the CLI does where no accelerator is visible:
    libtpu (installed with the test extra, as with the `tpu` one) prints no start-up errors."""
    if os.environ.get("JAX_PLATFORMS") != "cpu" or visible_accelerator() is not False:
        pytest.skip("needs a machine without an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import rloo_jax, jax, jax.numpy as jnp; print(jax.devices()[0].platform, float(jnp.ones(2).sum()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["cpu", "2.0"], r.stderr[-3000:]
    assert r.stderr == "", r.stderr


def test_cli_default_run_writes_every_output(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ)  # the platform the suite runs on (conftest): the CPU, or the accelerator
    # `make run` sets no JAX_PLATFORMS: on a machine without an accelerator the CLI itself picks the CPU
    # (skip_absent_tpu), where libtpu (installed with the test extra) would print start-up errors
    auto = env.get("JAX_PLATFORMS") == "cpu" and visible_accelerator() is False
    if auto:
        del env["JAX_PLATFORMS"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rloo_jax.train",
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--logging_steps",
            "2",
            "--save_steps",
            "2",
            "--eval_steps",
            "4",
            "--log_completions",
            "true",
            *SMALL[:6],
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "running the built-in demo" in r.stdout and f"Outputs in {out}" in r.stdout
    assert "step 4" in r.stdout and "advantage" in r.stdout  # log_completions: the logged steps' completions printed
    if auto:  # nothing on stderr: no libtpu start-up errors, no "PyTorch was not found", no warnings
        assert r.stderr == "", r.stderr
    metrics = read_jsonl(out / "metrics.jsonl")
    train_rows = [m for m in metrics if "reward" in m]
    assert [m["step"] for m in train_rows] == [2, 4]
    for key in REQUIRED:
        assert key in train_rows[0], key
    assert train_rows[0]["learning_rate"] == pytest.approx(1e-3) and train_rows[0]["step_time"] > 0
    evals = [m for m in metrics if "eval_reward" in m]
    assert len(evals) == 1 and evals[0]["step"] == 4 and "eval_rewards/echo_reward/mean" in evals[0]
    rollouts = read_jsonl(out / "rollouts.jsonl")
    assert len(rollouts) == 2 * 32 and {r["step"] for r in rollouts} == {2, 4}
    rec = rollouts[0]
    assert set(rec) == {"step", "prompt", "completion", "rewards", "reward", "advantage", "length", "truncated",
                        "completion_ids", "logprobs"}
    tok = demo.build_tokenizer()
    for r in rollouts:  # the sampled tokens themselves (EOS-cut), and the sampler's and reference's log-probs
        assert len(r["completion_ids"]) == r["length"] and set(r["logprobs"]) == {"sampler", "reference"}
        assert tok.decode(r["completion_ids"], skip_special_tokens=True) == r["completion"]
        assert all(len(v) == r["length"] and all(x <= 0 for x in v) for v in r["logprobs"].values())
        assert r["truncated"] == (tok.eos_token_id not in r["completion_ids"])
    assert rec["reward"] == pytest.approx(demo.echo_reward([rec["completion"]], [rec["prompt"][:3]])[0])
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out / "final"))
    assert "num_generations: 4" in (out / "config.yaml").read_text()


def test_resume_continues_at_the_right_step_and_matches_a_straight_run(tmp_path, capsys):
    # scanned (stacked) layers: the CPU default unrolls, which the kill -9 test of test_reliability.py resumes
    common = [*SMALL, "--logging_steps", "1", "--save_steps", "2", "--scan_layers", "true"]
    assert main(["--output_dir", str(tmp_path / "straight"), "--max_steps", "4", *common]) == 0
    assert main(["--output_dir", str(tmp_path / "resumed"), "--max_steps", "2", *common]) == 0
    capsys.readouterr()
    assert main(["--output_dir", str(tmp_path / "resumed"), "--max_steps", "4", *common]) == 0
    printed = capsys.readouterr().out
    assert "Resuming from checkpoint" in printed
    assert "advantage" not in printed  # no log_completions: the last step's completions are written, not printed
    straight = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):  # same data order, keys and updates after the resume
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # a checkpoint restores onto the layout it was written with: the other one is a one-line error, nothing lost
    common[-1] = "false"
    assert main(["--output_dir", str(tmp_path / "resumed"), "--max_steps", "6", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: checkpoint 4 holds the stacked parameter layout of scan_layers=true; resume with "
                   "--scan_layers true (the numbers are the same)"]
    assert [m["step"] for m in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_reward_error_stops_and_keeps_the_last_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--output_dir", str(out), "--max_steps", "2", "--save_steps", "2", *SMALL]) == 0
    before = {p: os.path.getmtime(p) for p in glob.glob(str(out / "checkpoints" / "**"), recursive=True)}
    rc = main(
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--save_steps",
            "1",
            *SMALL,
            "--reward_funcs",
            "tests.test_train:broken_reward",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "reward function 'broken_reward' raised ZeroDivisionError" in err and "on sample 0" in err
    after = {p: os.path.getmtime(p) for p in glob.glob(str(out / "checkpoints" / "**"), recursive=True)}
    assert after == before and sorted(os.listdir(out / "checkpoints")) == ["2"]


def broken_reward(completions, **kwargs):
    return [1 / 0 for _ in completions]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model_name_or_path", "/nonexistent/model", "--dataset_name", "demo"], "checkpoint path does not exist"),
        (["--model_name_or_path", "demo", "--dataset_name", "/nonexistent/data.jsonl"], "no such file or folder"),
        (
            ["--model_name_or_path", "demo", "--dataset_name", "demo", "--reward_funcs", "nosuch_mod_q:f"],
            "cannot import 'nosuch_mod_q'",
        ),
        (["--model_name_or_path", "demo", "--dataset_name", "demo", "--report_to", "wandb"], "rloo_jax\\[wandb\\]"),
    ],
)
def test_load_errors_exit_2_and_touch_nothing(tmp_path, capsys, args, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    out = tmp_path / "existing"
    out.mkdir()
    (out / "metrics.jsonl").write_text("keep\n")
    base = ["--reward_funcs", "rloo_jax.demo:letters_reward"] if "--reward_funcs" not in args else []
    assert main([*args, *base, "--output_dir", str(out), "--compilation_cache", "false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err) and "Traceback" not in err
    assert err.count("\n") == 1
    assert os.listdir(out) == ["metrics.jsonl"] and (out / "metrics.jsonl").read_text() == "keep\n"


# ------------------------------------------------------------------------------------------------ configs
@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from rloo_jax.models import init_reward_model, save_pretrained

    d = tmp_path_factory.mktemp("assets")
    policy = demo.prepare_model(d / "policy", seed=0)
    cfg = dict(demo.MODEL_CONFIG, architectures=["Qwen2ForSequenceClassification"])
    save_pretrained(init_reward_model(cfg, seed=1), d / "rm", tokenizer=demo.build_tokenizer())
    rows = demo.make_rows(16, seed=0)
    (d / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": "#### 3"} for r in rows]
    (d / "chat_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (d / "chat_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat[:4]))
    return {
        "policy": policy,
        "rm": str(d / "rm"),
        "text": str(d / "text.jsonl"),
        "chat_train": str(d / "chat_train.jsonl"),
        "chat_test": str(d / "chat_test.jsonl"),
    }


def test_every_shipped_config_validates():
    from rloo_jax.cli import config_from_dict, load_config

    files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert {os.path.basename(f) for f in files} >= {
        "default.yaml",
        "tldr_pythia1b.yaml",
        "math_qwen05b.yaml",
        "tpu_pod.yaml",
        "grpo_math_qwen15b.yaml",
        "ppo_tldr_pythia1b.yaml",
    }
    for f in files:
        load_config(["--config", f])
    assert load_config(["--config", os.path.join(ROOT, "configs", "default.yaml")]) == config_from_dict(
        demo.DEFAULT_CONFIG
    )


@pytest.mark.parametrize("name", ["tldr_pythia1b", "math_qwen05b", "tpu_pod", "grpo_math_qwen15b"])
def test_shipped_configs_run_two_steps_on_tiny_local_stand_ins(name, tiny_assets, tmp_path):
    swap = {
        "tldr_pythia1b": [
            "--reward_model_name_or_path",
            tiny_assets["rm"],
            "--dataset_name",
            tiny_assets["text"],
            "--dataset_test_split",
            tiny_assets["text"],
            "--per_device_train_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "2",
        ],
        "math_qwen05b": [
            "--dataset_name",
            tiny_assets["chat_train"],
            "--dataset_test_split",
            tiny_assets["chat_test"],
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "4",
            "--per_device_train_batch_size",
            "16",
        ],
        "grpo_math_qwen15b": [
            "--dataset_name",
            tiny_assets["chat_train"],
            "--dataset_test_split",
            tiny_assets["chat_test"],
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "4",
            "--num_generations",
            "4",
            "--steps_per_generation",
            "1",
            "--completion_bucket",
            "0",
        ],
        "tpu_pod": [
            "--dataset_name",
            tiny_assets["chat_train"],
            "--dataset_test_split",
            tiny_assets["chat_test"],
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "1",
            "--steps_per_generation",
            "2",
            "--num_generations",
            "4",
            "--soft_overlong_cache",
            "4",
        ],
    }[name]
    out = tmp_path / name
    args = [
        "--config",
        os.path.join(ROOT, "configs", f"{name}.yaml"),
        "--model_name_or_path",
        tiny_assets["policy"],
        *swap,
        "--max_steps",
        "2",
        "--max_completion_length",
        "6",
        "--output_dir",
        str(out),
        "--compilation_cache",
        "false",
        "--logging_steps",
        "1",
        "--save_steps",
        "2",
    ]
    assert main(args) == 0
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]  # one record per optimizer step
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert ("loss_type: grpo" in (out / "config.yaml").read_text()) == (name == "grpo_math_qwen15b")
    assert os.path.isdir(out / "final") and os.listdir(out / "checkpoints") == ["2"]


def test_ppo_tldr_config_runs_two_updates_on_tiny_local_stand_ins(tiny_assets, tmp_path):
    """configs/ppo_tldr_pythia1b.yaml with local stand-ins for its hub folders (the demo policy and tokenizer, a
    tiny reward model that also starts the value model; the demo tokenizer has a pad of its own)."""
    out = tmp_path / "ppo"
    args = ["--config", os.path.join(ROOT, "configs", "ppo_tldr_pythia1b.yaml"), "--model_name_or_path",
            tiny_assets["policy"], "--sft_model_path", tiny_assets["policy"], "--reward_model_path", tiny_assets["rm"],
            "--pad_token", "None", "--dataset_name", tiny_assets["text"], "--dataset_test_split", tiny_assets["text"],
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "2",
            "--response_length", "6", "--eval_steps", "2", "--per_device_eval_batch_size", "4", "--output_dir",
            str(out), "--compilation_cache", "false", "--save_steps", "2"]
    assert main(args) == 0
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "objective/kl" in m]  # one record per PPO update
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss/value_avg"]) for r in rows)
    assert [r["episode"] for r in rows] == [8, 16] and rows[1]["lr"] < rows[0]["lr"]
    assert any("eval_reward" in m for m in read_jsonl(out / "metrics.jsonl"))
    assert "algorithm: ppo" in (out / "config.yaml").read_text()
    assert os.path.isdir(out / "final") and os.path.isdir(out / "final_value")
    assert os.listdir(out / "checkpoints") == ["2"]


# ------------------------------------------------------------------------------------------------ learning
@pytest.mark.slow  # the default run itself: 300 steps of 256 completions (~70 s on the loaded 2-core machine)
def test_default_demo_learns_the_answers(tmp_path):
    """`make run` as it is: the reward climbs from ~0.01 to >= 0.7 and most of the last step's completions are their
    prompts' answers. Where it ends depends on the host: 300 steps of sampling amplify XLA:CPU's last-bit
    differences between host CPUs. Measured on 2-core machines of this project: final reward 0.777, 191 of 256 exact,
    13 of 17 prompts' majority right (2026-11-28); 0.92 / 224 of 256 (issue 39's host); 0.95 / 253 of 256 (the
    README's); an H200 in bf16: >= 0.9 / 224 of 256. The thresholds sit below the lowest."""
    out = tmp_path / "learn"
    r = cli_at_xla_defaults("--output_dir", str(out), "--eval_steps", "None", "--save_steps", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    rewards = [m["reward"] for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert rewards[0] < 0.1 and rewards[-1] >= 0.7, rewards
    last = read_jsonl(out / "rollouts.jsonl")  # the last step's 256 completions (log_completions is off)
    assert len(last) == 256 and {r["step"] for r in last} == {300}
    exact = [r["completion"] == r["prompt"].removesuffix(":") for r in last]
    assert np.mean(exact) >= 0.7, [(r["prompt"], r["completion"]) for r in last]
    by_prompt = {}
    for r, ok in zip(last, exact, strict=True):
        by_prompt.setdefault(r["prompt"], []).append(ok)
    right = [np.mean(v) > 0.5 for v in by_prompt.values()]
    assert len(by_prompt) >= 10 and np.mean(right) >= 0.7, by_prompt


def test_echo_reward_goldens():
    got = demo.echo_reward(["ace", "acex", "ac", "a", "xce", "", [{"content": "ace"}]], letters=["ace"] * 7)
    assert got == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 1.0]


def test_demo_figures_script(tmp_path):
    """scripts/demo_figures.py (CI's line after `make run`): the README's figures from a run's records, exit 1 below
    the 0.7 evaluation floor. Records made by hand: rewards 0.1 -> 0.9 over 2 steps, evaluation 0.8 then 0.65, and
    the last step's 3 completions of which 2 are their prompt's answer."""
    metrics = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.9}, {"step": 2, "eval_reward": 0.8}]
    rollouts = [{"step": 1, "prompt": "ab:", "completion": "ab"}, {"step": 2, "prompt": "ab:", "completion": "ab"},
                {"step": 2, "prompt": "cd:", "completion": "cd"}, {"step": 2, "prompt": "ef:", "completion": "e"}]
    for name, records in (("metrics.jsonl", metrics), ("rollouts.jsonl", rollouts)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    script = [sys.executable, os.path.join(ROOT, "scripts", "demo_figures.py"), str(tmp_path)]
    done = subprocess.run(script, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "demo: reward 0.100 -> 0.900 over 2 steps, evaluation 0.800, 2 of "
                                                 "the last step's 3 completions are their prompt's answer\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics[:2] + [
        {"step": 2, "eval_reward": 0.65}]))
    done = subprocess.run(script, capture_output=True, text=True)
    assert done.returncode == 1 and "below 0.7: the demo did not learn its task" in done.stdout, done.stdout
