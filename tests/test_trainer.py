"""`rloo_jax.RLOOTrainer` (TRL 1.16's Python API): the same run as the CLI, TRL's reward keyword arguments,
datasets as objects, peft's LoraConfig, the per-phase timings and the W&B run id."""

import json
import sys
import types

import datasets
import numpy as np
import pytest

import rloo_jax
from rloo_jax import demo
from rloo_jax.cli import main
from rloo_jax.errors import ConfigError
from rloo_jax.given import lora_options
from rloo_jax.metrics import Sinks, read_jsonl
from rloo_jax.timing import phase_timings

# the demo task, shrunk: 4 prompts x G=4 per step, 8-token completions
SETTINGS = dict(
    per_device_train_batch_size=16, num_generations=4, max_completion_length=8, max_prompt_length=16, prompt_bucket=8,
    learning_rate=1e-3, lr_scheduler_type="constant", beta=0.02, seed=0, logging_steps=1, save_steps=2,
    compilation_cache=False,
)
TIMINGS = ("timing/sample", "timing/reference", "timing/reward", "timing/update")


def cli_args(settings):
    return [x for k, v in settings.items() for x in (f"--{k}", str(v))]


@pytest.mark.slow  # three short runs, each compiling its step (~117 s on the loaded 2-core machine)
def test_trainer_with_a_callable_and_a_dataset_matches_the_cli(tmp_path, capsys):
    """The acceptance test of the Python API: RLOOTrainer with a Python callable and an in-memory Dataset gives the
    CLI's metrics (module:function reward, .jsonl file) on the same data and seed, bit for bit; a second train()
    resumes from output_dir as the CLI does."""
    rows = demo.make_rows(32, seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = tmp_path / "cli"
    assert main(["--model_name_or_path", "demo", "--dataset_name", str(data), "--reward_funcs",
                 "rloo_jax.demo:letters_reward", "--output_dir", str(cli), "--max_steps", "3",
                 *cli_args(SETTINGS)]) == 0
    api = tmp_path / "api"
    args = rloo_jax.RLOOConfig(output_dir=str(api), max_steps=2, **SETTINGS)
    dataset = datasets.Dataset.from_list(rows)
    trainer = rloo_jax.RLOOTrainer("demo", demo.letters_reward, args=args, train_dataset=dataset)
    assert trainer.train().global_step == 2
    assert trainer.state.log_history[-2]["learning_rate"] == pytest.approx(1e-3)  # (the last: the run's summary)
    capsys.readouterr()
    args = rloo_jax.RLOOConfig(output_dir=str(api), max_steps=3, **SETTINGS)
    again = rloo_jax.RLOOTrainer("demo", [demo.letters_reward], args=args, train_dataset=rows)  # list of dicts
    again.train(resume_from_checkpoint=True)
    final = again.state.log_history[-2]  # the last step's record
    assert "Resuming from checkpoint" in capsys.readouterr().out

    def without_timings(record):
        return {k: v for k, v in record.items() if k not in (*TIMINGS, "step_time")}

    expected, got = read_jsonl(cli / "metrics.jsonl"), read_jsonl(api / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3] and "rewards/letters_reward/mean" in got[0]
    assert [without_timings(r) for r in got] == [without_timings(r) for r in expected]
    assert without_timings(final) == without_timings(expected[-1])
    assert (api / "final" / "model.safetensors").is_file()
    # per-phase timings: where the host waits anyway, together 0.85-1.05 of step_time (they partition it)
    for record in expected + got:
        assert all(record[k] >= 0 for k in TIMINGS), record
        assert 0.85 <= sum(record[k] for k in TIMINGS) / record["step_time"] <= 1.05, record


def test_reward_functions_get_trls_keyword_arguments(tmp_path):
    """prompts, completions, completion_ids, trainer_state, log_extra, log_metric and the other columns; log_metric
    values are logged (train and eval), log_extra columns land in rollouts.jsonl. The training set is an
    IterableDataset (read in stream order up to what max_steps needs), the evaluation set a list of dicts."""
    rows = demo.make_rows(16, seed=1)
    calls = []

    def probe(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns):
        calls.append((sorted(columns), trainer_state.global_step, trainer_state.max_steps, len(completions)))
        assert len(prompts) == len(completion_ids) == len(columns["letters"]) == len(completions)
        log_metric("probe/length", float(np.mean([len(ids) for ids in completion_ids])))
        log_extra("first", [c[:1] for c in completions])
        return demo.letters_reward(completions, **columns)

    stream = datasets.IterableDataset.from_generator(lambda: iter(rows))
    settings = dict(SETTINGS, per_device_train_batch_size=8, eval_steps=2, per_device_eval_batch_size=8,
                    num_generations_eval=2, log_completions=True)
    args = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "run"), max_steps=2, **settings)
    trainer = rloo_jax.RLOOTrainer("demo", probe, args=args, train_dataset=stream, eval_dataset=rows[:4])
    assert len(trainer.train_dataset) == 4  # 2 steps x 2 prompts, in stream order
    assert trainer.train_dataset["prompt"] == [r["prompt"] for r in rows[:4]]
    trainer.train()
    metrics = trainer.result.metrics  # the last logged step's, with the evaluation's
    assert calls == [(["letters"], 0, 2, 8), (["letters"], 1, 2, 8), (["letters"], 2, 2, 8)]  # train, train, eval
    assert {"probe/length", "eval_probe/length", "eval_reward", *TIMINGS} <= set(metrics)
    assert 0 < metrics["probe/length"] <= 8
    assert trainer.state.global_step == 2 and [r["step"] for r in trainer.state.log_history] == [1, 2, 2, 2]  # +eval,
    assert "train_loss" in trainer.state.log_history[-1]  # + the end-of-training record
    records = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert len(records) == 16 and all(r["extra"]["first"] == r["completion"][:1] for r in records)


def test_trainer_refuses_what_it_cannot_take(tmp_path):
    rows = demo.make_rows(8, seed=0)
    args = rloo_jax.RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(ConfigError, match="an IterableDataset has no length: set args.max_steps"):
        stream = datasets.IterableDataset.from_generator(lambda: iter(rows))
        rloo_jax.RLOOTrainer("demo", demo.letters_reward, args, stream)
    with pytest.raises(ConfigError, match="model must be a local folder, a hub id, a transformers PreTrainedModel or "
                                          "a peft PeftModel \\(got type object\\)"):
        rloo_jax.RLOOTrainer(object(), demo.letters_reward, args, rows)
    with pytest.raises(ConfigError, match=r"reward processing classes \(2\) must match the number of reward"):
        rloo_jax.RLOOTrainer("demo", demo.letters_reward, args, rows, reward_processing_classes=[None, None])
    with pytest.raises(ConfigError, match="`train_dataset` is required"):
        rloo_jax.RLOOTrainer("demo", demo.letters_reward, args)
    with pytest.raises(Exception, match="has no `prompt` column"):
        rloo_jax.RLOOTrainer("demo", demo.letters_reward, args, [{"question": "a"}])


def test_peft_lora_config_maps_onto_our_lora_options():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM")
    assert lora_options(config) == {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                                    "lora_target_modules": ["q_proj", "v_proj"], "use_rslora": False}
    assert lora_options({"lora_r": 4, "target_modules": "all-linear"}) == {
        "use_peft": True, "lora_r": 4, "lora_target_modules": ["all-linear"]}
    with pytest.raises(ConfigError, match="use_dora=True is not supported"):
        lora_options(peft.LoraConfig(r=8, use_dora=True))
    with pytest.raises(ConfigError, match="only LoRA is supported"):
        lora_options(peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))


def test_phase_timings_golden():
    assert phase_timings(0, 2, 5, 6, 9) == {"timing/sample": 2, "timing/reference": 1, "timing/reward": 3,
                                            "timing/update": 3}
    assert phase_timings(0, 2, 5, 4, 9) == {"timing/sample": 2, "timing/reference": 0, "timing/reward": 3,
                                            "timing/update": 4}  # the reference pass hid behind the rewards
    assert phase_timings(0, 2, 5, None, 9)["timing/update"] == 4  # beta 0: no reference pass
    assert sum(phase_timings(1, 2, 5, 7, 9).values()) == 9 - 1


def test_wandb_run_id_is_kept_in_output_dir_and_run_name_is_the_name(tmp_path, monkeypatch):
    inits = []
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):  # a run and its resume
        Sinks(str(tmp_path), ["wandb"], {"seed": 0}, "my-run").close()
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    assert inits[0]["name"] == "my-run" and inits[0]["resume"] == "allow"
