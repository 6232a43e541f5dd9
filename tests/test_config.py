"""RLOOConfig: YAML + command-line parsing, types, aliases, suggestions, and every validation rule."""

import dataclasses
import logging
import os
import subprocess
import sys

import pytest

from rloo_jax import errors
from rloo_jax.algorithms import RLOOConfig
from rloo_jax.cli import config_from_dict, load_config
from rloo_jax.config import coerce, format_help, parse_argv
from rloo_jax.errors import ConfigError

BASE = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "pkg.mod:f"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(**kw):
    values = {"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["pkg.mod:f"]}
    values.update(kw)
    return config_from_dict(values)


def test_defaults_follow_trl():
    cfg = make()
    assert (cfg.learning_rate, cfg.beta, cfg.epsilon, cfg.num_generations) == (1e-6, 0.05, 0.2, 2)
    assert (cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k) == (512, 1.0, 1.0, 0)
    assert (cfg.per_device_train_batch_size, cfg.logging_steps, cfg.lr_scheduler_type) == (8, 10, "linear")
    assert cfg.trust_remote_code is False and cfg.report_to == ["none"] and cfg.full_determinism is False
    # platform-dependent (rloo_jax.numerics): bf16 on for TPU/GPU as TRL on GPUs, precision from the dtype
    assert cfg.bf16 is None and cfg.matmul_precision is None and cfg.recompute_old_logps is None
    # TRL GRPO's importance-sampling defaults (correction off here: docs/numerics.md says why)
    assert (cfg.importance_sampling_correction, cfg.importance_sampling_mode) == (False, "sequence_mask")
    assert (cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max) == (None, 3.0)


def test_yaml_then_overrides_and_types(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "model_name_or_path: m\ndataset_name: d\nreward_funcs: [a.b:c, accuracy]\nlearning_rate: 1e-3\n"
        "num_generations: 4\nreward_clip_range: [-1, 1]\nchat_template_kwargs: {enable_thinking: false}\n"
    )
    cfg = load_config(
        [
            "--config",
            str(f),
            "--learning_rate=5e-4",
            "--bf16",
            "--mask_truncated_completions",
            "1",
            "--reward_weights",
            "1,0.5",
            "--top_p",
            "0.9",
            "--eval_steps",
            "None",
            "--debug",
        ]
    )
    assert cfg.learning_rate == 5e-4  # command line wins over the file; YAML's "1e-3" string parsed as float
    assert cfg.num_generations == 4 and cfg.bf16 is True and cfg.mask_truncated_completions is True
    assert cfg.reward_funcs == ["a.b:c", "accuracy"] and cfg.reward_weights == [1.0, 0.5]
    assert cfg.reward_clip_range == (-1.0, 1.0) and cfg.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.top_p == 0.9 and cfg.eval_steps is None and cfg.debug is True


def test_coerce_rules():
    assert coerce("false", bool, "x") is False and coerce("1", bool, "x") is True
    assert coerce("3", int, "x") == 3 and coerce("1e3", int, "x") == 1000
    assert coerce("a, b,", list[str], "x") == ["a", "b"]
    assert coerce("[1, 2]", list[float], "x") == [1.0, 2.0]
    assert coerce("null", int | None, "x") is None
    assert coerce("(0, 2)", tuple[float, float], "x") == (0.0, 2.0)
    assert coerce('{"a": 1}', dict | None, "x") == {"a": 1}
    for value, ann in (("maybe", bool), ("1.5", int), ("abc", float), ("1", tuple[float, float]), ("[1]", dict)):
        with pytest.raises(ConfigError, match="x"):
            coerce(value, ann, "x")


def test_aliases_map_to_new_names_with_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        cfg = load_config(BASE + ["--rloo_k", "4", "--kl_coef", "0.1", "--cliprange=0.3", "--num_ppo_epochs", "2"])
    assert (cfg.num_generations, cfg.beta, cfg.epsilon, cfg.num_iterations) == (4, 0.1, 0.3, 2)
    assert "`rloo_k` is the old TRL name of `num_generations`" in caplog.text


def test_trl_grpo_vllm_importance_sampling_names_are_aliases(caplog):
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        cfg = load_config(BASE + ["--vllm_importance_sampling_correction", "--vllm_importance_sampling_mode",
                                  "sequence_truncate", "--vllm_importance_sampling_clip_min", "0.5",
                                  "--vllm_importance_sampling_cap", "2"])
    assert cfg.importance_sampling_correction is True and cfg.importance_sampling_mode == "sequence_truncate"
    assert (cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max) == (0.5, 2.0)
    assert "`vllm_importance_sampling_cap` is TRL GRPO's name of `importance_sampling_clip_max`" in caplog.text


def test_numerics_options_parse_and_bare_flags():
    cfg = load_config(BASE + ["--bf16", "--matmul_precision", "tensorfloat32", "--full_determinism"])
    assert (cfg.bf16, cfg.matmul_precision, cfg.full_determinism) == (True, "tensorfloat32", True)
    assert load_config(BASE + ["--bf16", "None", "--gradient_checkpointing", "--seed", "1"]).gradient_checkpointing
    with pytest.raises(ConfigError) as e:
        load_config(BASE + ["--matmul_precision", "fp8"])
    assert str(e.value) == ("matmul_precision: 'fp8' is not one of default, high, highest, bfloat16, tensorfloat32, "
                            "float32")


def test_unknown_option_suggests_nearest():
    with pytest.raises(ConfigError, match="did you mean --learning_rate"):
        load_config(BASE + ["--learning_rte", "1"])
    with pytest.raises(ConfigError, match="unknown option 'zzz'"):
        load_config(BASE + ["--zzz", "1"])


def test_parse_argv_forms():
    path, values = parse_argv(["--config", "x.yaml", "--seed=3", "--debug", "--temperature", "0.5"], RLOOConfig)
    assert path == "x.yaml" and values == {"seed": "3", "debug": "true", "temperature": "0.5"}
    with pytest.raises(ConfigError, match="needs a value"):
        parse_argv(["--seed"], RLOOConfig)
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_argv(["seed"], RLOOConfig)


def test_derived_values():
    cfg = make(per_device_train_batch_size=6, gradient_accumulation_steps=2, num_generations=3, epsilon=0.1)
    assert cfg.resolved_steps_per_generation == 2 and cfg.generation_batch_size == 12
    assert cfg.prompts_per_generation == 4 and cfg.resolved_epsilon_high == 0.1
    assert cfg.resolved_num_generations_eval == 3 and cfg.resolved_reward_weights == [1.0]
    cfg = make(
        reward_model_name_or_path="a/rm",
        reward_weights=[1, 2],
        epsilon_high=0.28,
        num_generations_eval=1,
        per_device_eval_batch_size=3,
    )
    assert cfg.reward_sources == ["a/rm", "pkg.mod:f"] and cfg.resolved_epsilon_high == 0.28  # TRL: the model first
    assert cfg.resolved_soft_overlong_cache == 128


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_name_or_path": None}, "model_name_or_path is required"),
        ({"dataset_name": ""}, "dataset_name is required"),
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"per_device_train_batch_size": 6, "num_generations": 4}, "must be divisible by num_generations = 4"),
        ({"per_device_eval_batch_size": 5, "eval_steps": 2}, "per_device_eval_batch_size .5. must be divisible"),
        ({"learning_rate": 0}, "learning_rate must be > 0"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 2}, "min_p must be in"),
        ({"epsilon": 0}, "epsilon must be > 0"),
        ({"epsilon_high": -1}, "epsilon_high must be > 0"),
        ({"max_completion_length": 0}, "max_completion_length must be >= 1"),
        ({"max_prompt_length": 0}, "max_prompt_length must be >= 1"),
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"max_steps": 0}, "max_steps must be >= 1"),
        ({"warmup_ratio": 1}, r"warmup_ratio must be in \[0, 1\)"),
        ({"adam_beta2": 1}, "adam_beta2 must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"sync_ref_model": True, "beta": 0}, "sync_ref_model needs a reference model"),
        ({"ref_model_mixup_alpha": 2}, "ref_model_mixup_alpha must be in"),
        ({"reward_clip_range": (1, 0)}, "min < max"),
        ({"reward_funcs": None}, "no reward"),
        ({"reward_weights": [1, 2]}, r"Number of reward weights \(2\) must match number of reward functions \(1"),
        ({"report_to": "tensorbord"}, "unknown sink 'tensorbord'"),
        ({"lr_scheduler_type": "cosin"}, "did you mean 'cosine'"),
        ({"kl_estimator": "k4"}, "not one of k1, k2, k3"),
        ({"dataset_name": "tfds:"}, "needs a dataset name"),
        ({"dataset_name": "tfds:glue/sst2/x"}, r"dataset_name: `tfds:glue/sst2/x` is not a TFDS dataset name"),
        ({"dataset_name": "tfds:glue/cola", "dataset_config": "sst2"}, "names config 'cola' but dataset_config"),
        ({"tfds_data_dir": "gs://b/tfds"}, "tfds_data_dir is only read for `tfds:` datasets .dataset_name is 'd'"),
        ({"logging_steps": 0}, r"logging_steps must be an integer >= 1 \(steps\) or a float in \(0, 1\)"),
        ({"save_steps": 2.5}, r"save_steps must be an integer >= 1 \(steps\) or a float in \(0, 1\)"),
        ({"eval_steps": 1.0001}, r"eval_steps must be an integer >= 1 \(steps\) or a float in \(0, 1\) \(a ratio of "
                                 r"the run's steps\) or None"),
        ({"logging_steps": "x"}, "logging_steps must be a number"),
        ({"per_device_eval_batch_size": 5, "eval_strategy": "epoch"}, "per_device_eval_batch_size .5. must be "
                                                                      "divisible"),
        ({"num_generations_eval": 0}, "num_generations_eval must be >= 1"),
        ({"matmul_precision": "highets"}, "did you mean 'highest'"),
        ({"recompute_old_logps": False, "num_iterations": 2}, "recompute_old_logps false: this run is off-policy"),
        ({"importance_sampling_clip_min": 2.0, "importance_sampling_clip_max": 2.0}, "must be below"),
        ({"importance_sampling_clip_max": 0}, "importance_sampling_clip_max must be > 0"),
        ({"importance_sampling_correction": True, "importance_sampling_mode": "token_mask"},
         "RLOO's loss is per sequence"),
        ({"importance_sampling_correction": True, "importance_sampling_mode": "sequence_truncate",
          "importance_sampling_clip_max": None}, "set importance_sampling_clip_min and/or"),
    ],
)
def test_validation_messages(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make(**overrides)


def test_steps_per_generation_need_not_be_a_multiple_of_gradient_accumulation_steps():
    """TRL runs any two values: an optimizer step may span generation batches (rloo_jax.step.UpdatePlan)."""
    cfg = make(steps_per_generation=3, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=-1)
    assert not cfg.on_policy and cfg.micro_per_generation == 3 and cfg.steps_per_generation_batch == 1
    assert cfg.total_steps(num_prompts=12) == 9  # 3 epochs x 2 generation batches x 3 micro-batches / 2
    # TRL's on-policy rule: gradient_accumulation_steps a multiple of steps_per_generation x num_iterations
    assert make(steps_per_generation=1, gradient_accumulation_steps=2, per_device_train_batch_size=4).on_policy


def test_tfds_name_and_data_dir_pass_validation_unchanged():
    cfg = make(dataset_name="tfds:glue/sst2:2.0.0", tfds_data_dir="gs://bucket/tensorflow_datasets")
    assert (cfg.dataset_name, cfg.tfds_data_dir) == ("tfds:glue/sst2:2.0.0", "gs://bucket/tensorflow_datasets")
    assert make(dataset_name="tfds:glue", dataset_config="sst2").tfds_data_dir is None


def test_validation_reruns_on_replace():
    with pytest.raises(ConfigError, match="num_generations"):
        dataclasses.replace(make(), num_generations=1)


def test_unreadable_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match=f"config file {bad} is not valid YAML"):
        load_config(["--config", str(bad)])
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        load_config(["--config", str(tmp_path / "missing.yaml")])
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(["--config", str(listy)])
    typo = tmp_path / "typo.yaml"
    typo.write_text("num_generation: 4\n")
    with pytest.raises(ConfigError, match=f"in {typo}; did you mean --num_generations"):
        load_config(["--config", str(typo)])


def test_help_lists_every_option_with_help_text():
    text = format_help(RLOOConfig)
    for f in dataclasses.fields(RLOOConfig):
        assert f"--{f.name} " in text, f.name
        assert f.metadata["help"] in text
    assert "rloo_k -> num_generations" in text


def test_yaml_round_trip():
    cfg = make(reward_clip_range=(0, 1), report_to="tensorboard,wandb", chat_template_kwargs={"a": 1})
    import yaml

    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def run_cli(*args, cwd=ROOT):
    env = dict(os.environ)  # the platform the suite runs on (conftest): the CPU, or the accelerator
    return subprocess.run(
        [sys.executable, "-m", "rloo_jax.train", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_cli_config_errors_exit_2_with_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("keep\n")
    r = run_cli(*BASE, "--num_generations", "1", "--output_dir", str(out))
    assert r.returncode == 2, r.stderr
    assert "num_generations must be >= 2" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert sorted(os.listdir(out)) == ["metrics.jsonl"] and (out / "metrics.jsonl").read_text() == "keep\n"
    r = run_cli(*BASE, "--lerning_rate", "1")
    assert r.returncode == 2 and "did you mean --learning_rate" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(*BASE, "--num_generations", "1", "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_cli_help_exits_0():
    r = run_cli("--help")
    assert r.returncode == 0 and "--num_generations" in r.stdout and "--learning_rate" in r.stdout


def test_errors_name_options_as_their_reader_writes_them():
    """The Python API's errors name its arguments, the command line's its flags (issue 39, item 8)."""
    with pytest.raises(ConfigError) as e:
        RLOOConfig(num_generations=1)
    assert "set num_generations 2 or more" in str(e.value) and "--" not in str(e.value)
    with pytest.raises(ConfigError, match="set --num_generations 2 or more"):
        load_config(BASE + ["--num_generations", "1"])
    # TRL's wording for a count mismatch, with the option to fix
    with pytest.raises(ConfigError, match=r"\(1 \(pkg.mod:f\)\); give --reward_weights one weight per function"):
        load_config(BASE + ["--reward_weights", "1,2"])
    with pytest.raises(ConfigError, match=r"give reward_weights one weight per function"):
        make(reward_weights=[1, 2])
    # a value that holds a double dash is not a flag
    assert errors.for_reader("pass x--y or --z") == "pass x--y or z"
