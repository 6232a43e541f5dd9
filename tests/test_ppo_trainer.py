"""PPO as a trainer (rloo_jax.PPOTrainer / `python -m rloo_jax.train ppo`): whole-trainer parity with TRL 1.12's
PPOTrainer (tests/ppo_parity.py), and the trainer's own contracts (bad inputs, exports)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tests import ppo_parity as pp
from tests.diffs import abs_diffs
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
    # a PeftModel with non-zero adapters as the policy: TRL 1.12's reference is its base, adapters off (objective/kl
    # 1.9 on both sides at the first update; a frozen copy of the adapters would give ~0). Weights compared: the
    # policy's adapters (measured 2.5e-6) and the value model, trained whole (VALUE_BOUND)
    "peft_model_policy": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
                              num_ppo_epochs=2, kl_estimator="k1", kl_coef=0.2, peft=True),
}
COMMON = dict(response_length=6, temperature=1.0, learning_rate=1e-3, seed=5)
# float32 on both sides: measured worst 4.8e-7 abs over every logged metric of both cases (objective/entropy; ratios
# and approxkl at the 1e-13 float floor), final weights 1.4e-5 apart (AdamW's first steps turn float noise in
# near-zero gradients into lr-sized moves)
TOLERANCE = dict(abs=1e-5, rel=1e-4)
# The PeftModel case's value model: one element (layers.1 q_proj [25, 4]) ends 6.7e-5 apart, every other within
# 3.3e-6 (measured). Its first accumulated gradient is 2.1e-8, 1e-5 of the matrix's typical one and about AdamW's eps
# (1e-8), so Adam's first step there, lr g / (|g| + eps), is 0.68 lr, and the gradient's float noise (8e-9 between
# two TRL runs) moves it by 7% of lr: TRL against itself, every model's initial weights x (1 + 2^-24 N(0, 1)),
# ends that element 6.7e-5 apart too (gradients 2.13e-8 vs 2.97e-8: steps 0.68 vs 0.75 lr). So: at most one element
# beyond 1e-5, none beyond 1e-4 (the bound the other cases put on all their weights); at lr 1e-3, a sign-flipped
# first step would be 2e-3 apart, drift everywhere would pass 1e-5 in many elements
VALUE_BOUND = dict(all_but_one=1e-5, max=1e-4)


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
    result = pp.compare(theirs, ours, "policy/" if options.get("peft") else "")
    for name, (abs_diff, rel_diff) in result["metrics"].items():
        assert abs_diff <= TOLERANCE["abs"] or rel_diff <= TOLERANCE["rel"], (name, abs_diff, rel_diff)
    assert result["weights"] <= 1e-4, result["weights"]
    assert os.path.isdir(tmp_path / "ours" / "final_value")
    if options.get("peft"):  # the value model, trained whole beside the adapters
        names = [k for k in theirs["weights"] if k.startswith("value/")]
        assert names and set(names) == {k for k in ours["weights"] if k.startswith("value/")}
        diffs = np.concatenate([abs_diffs(theirs["weights"][k], ours["weights"][k], k).ravel() for k in names])
        beyond = np.sort(diffs[diffs > VALUE_BOUND["all_but_one"]])
        assert len(beyond) <= 1 and diffs.max() <= VALUE_BOUND["max"], (beyond, diffs.max())


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
        rel.kill_when(out, cache, tmp_path / f"log{i}", PPO_RUN, condition, timeout=600)
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
    assert report["fits"] and set(report["programs"]) == {"rollout", "update", "score"}
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

    from rloo_jax.metrics import read_jsonl
    from tests.xla_flags import cli_at_xla_defaults

    out = tmp_path / "learn"
    r = cli_at_xla_defaults("ppo", "--output_dir", str(out), "--max_steps", "70", "--logging_steps", "5",
                            "--eval_steps", "None", "--save_steps", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    scores = [m["objective/scores"] for m in read_jsonl(out / "metrics.jsonl") if "objective/scores" in m]
    assert len(scores) == 14
    assert np.mean(scores[:2]) < 0.1 and np.mean(scores[-2:]) > 0.4, scores


# ------------------------------------------------------------------------------------------------ loaded models
# TRL 1.12's PPOTrainer takes loaded models (its example script: the policy and the reference loaded from one folder,
# the reward and the value model from another); ours writes them once under output_dir and names those folders.
LOADED_RUN = dict(total_episodes=8, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=1,
                  num_ppo_epochs=1, response_length=6, stop_token="eos", missing_eos_penalty=1.0, learning_rate=1e-3,
                  seed=5, bf16=False, report_to="none", logging_steps=1, save_steps=1000, log_completions=True)
# (the persistent compilation cache on, as in pp.run_ours: the second run of the same programs reuses the first's
# executables; measured on the loaded 2-core machine: 42 s for the first run, 6 s for the second instead of 38 s)


@pytest.fixture(scope="module")
def loaded_models(tmp_path_factory):
    """pp's tiny Qwen2 policy, reward and value models saved (the reward and value folders named as the loaded ones'
    are, so the metric names agree), and loaded back with transformers as TRL's example script loads them."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("ppo_loaded")
    paths = pp.build_models(str(root / "built"))
    folders = {"policy": root / "policy", "reward": root / "reward_model", "value": root / "value_model"}
    for name, folder in folders.items():
        shutil.move(paths[name], folder)
    return dict(
        folders=folders,
        policy=AutoModelForCausalLM.from_pretrained(folders["policy"]),
        ref=AutoModelForCausalLM.from_pretrained(folders["policy"]),
        reward=AutoModelForSequenceClassification.from_pretrained(folders["reward"], num_labels=1),
        value=AutoModelForSequenceClassification.from_pretrained(folders["value"], num_labels=1),
        data=[{"input_ids": ids} for ids in pp.prompts(12)],
    )


def _ppo(out, loaded_models, **models):
    from rloo_jax import PPOConfig, PPOTrainer

    args = PPOConfig(output_dir=str(out), **LOADED_RUN)
    return PPOTrainer(args=args, processing_class=None, train_dataset=loaded_models["data"], **models)


def _state_dict(model):
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _same_tensors(a, b):
    import numpy as np

    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow  # two 2-update runs, the second from the compilation cache: 53 s on the loaded 2-core machine
def test_ppo_loaded_models_train_as_their_folders(loaded_models, tmp_path, capsys):
    """PPOTrainer(model, ref_model, reward_model, value_model loaded) = PPOTrainer(their folders), 2 updates: the
    same metrics.jsonl records (timings aside), completions and final policy and value weights, bit for bit; the
    written folders hold the objects' state dicts and config.yaml names them; a second construction with the same
    objects (a resume) writes nothing and resumes."""
    import yaml
    from safetensors.numpy import load_file

    from rloo_jax.metrics import read_jsonl

    m, f = loaded_models, loaded_models["folders"]
    loaded, folder = tmp_path / "loaded", tmp_path / "folder"
    _ppo(loaded, m, model=m["policy"], ref_model=m["ref"], reward_model=m["reward"], value_model=m["value"]).train()
    _ppo(folder, m, model=str(f["policy"]), ref_model=None, reward_model=str(f["reward"]),
         value_model=str(f["value"])).train()

    def records(out):
        return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "eps")}
                for r in read_jsonl(out / "metrics.jsonl")]

    got = records(loaded)
    assert [r["step"] for r in got if "objective/kl" in r] == [1, 2]
    assert got == records(folder)
    assert read_jsonl(loaded / "rollouts.jsonl") == read_jsonl(folder / "rollouts.jsonl")
    for name in ("final", "final_value"):
        _same_tensors(load_file(str(loaded / name / "model.safetensors")),
                      load_file(str(folder / name / "model.safetensors")))
    trained = load_file(str(loaded / "final" / "model.safetensors"))["lm_head.weight"]
    assert not (trained == m["policy"].lm_head.weight.detach().numpy()).all()  # it trained

    config = yaml.safe_load((loaded / "config.yaml").read_text())
    written = {"sft_model_path": ("base_model", m["policy"]), "reward_model_path": ("reward_model", m["reward"]),
               "value_model_path": ("value_model", m["value"])}
    for option, (name, model) in written.items():
        assert config[option] == str(loaded / name), option
        _same_tensors(load_file(str(loaded / name / "model.safetensors")), _state_dict(model))
    assert (loaded / "base_model" / "tokenizer.json").is_file()

    mtimes = {p: p.stat().st_mtime_ns for name, _ in written.values() for p in (loaded / name).iterdir()}
    capsys.readouterr()
    again = _ppo(loaded, m, model=m["policy"], ref_model=m["ref"], reward_model=m["reward"], value_model=m["value"])
    assert {k: getattr(again.args, k) for k in written} == {k: config[k] for k in written}
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert again.train(resume_from_checkpoint=True).global_step == 2  # resumed at its end: nothing left to run
    assert "Resuming from checkpoint" in capsys.readouterr().out


def test_ppo_loaded_models_checked_and_shared(loaded_models, tmp_path):
    """No training: a reference with other weights than the policy's (a PeftModel's: its base's) and objects of
    the wrong kind are refused before anything is written; a loaded reference is compared with a policy folder (and
    a reference folder with a loaded policy); a value model holding the same model as the loaded reward model (or
    policy) names that folder instead of writing another; a loaded causal LM value model is written as one."""
    import json

    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rloo_jax.errors import ConfigError
    from rloo_jax.models import ModelLoadError

    m, f = loaded_models, loaded_models["folders"]
    out = tmp_path / "run"
    changed = AutoModelForCausalLM.from_pretrained(f["policy"])
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-6
    for ref in (changed, f["reward"]):
        with pytest.raises(ConfigError, match="ref_model: only the initial policy is supported as the reference"):
            _ppo(out, m, model=m["policy"], ref_model=ref, reward_model=m["reward"])
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight differs"):
        _ppo(out, m, model=str(f["policy"]), ref_model=changed, reward_model=str(f["reward"]))
    for kwargs, match in (
        (dict(model=torch.nn.Linear(2, 2)), "model must be a local folder, a hub id, a transformers PreTrainedModel "
                                            "or a peft PeftModel"),
        (dict(reward_model=torch.nn.Linear(2, 2)), "reward_model must be a local folder, a hub id or a loaded "
                                                   "transformers PreTrainedModel .*got a torch module that is not"),
        (dict(value_model=3), "value_model must be .*causal LM\\); got a int"),
        (dict(ref_model=peft.get_peft_model(AutoModelForCausalLM.from_pretrained(f["policy"]),
                                            peft.LoraConfig(r=2, target_modules=["q_proj"]))),
         "ref_model must be .*got a peft PeftModel"),
        (dict(reward_funcs=[m["reward"]]), "reward_funcs\\[0\\] is a Qwen2ForSequenceClassification: .*pass a "
                                           "reward model as reward_model"),
    ):
        with pytest.raises(ConfigError, match=match):
            _ppo(out, m, **{"model": m["policy"], "reward_model": m["reward"], **kwargs})
    assert not out.exists()  # nothing written by a refused construction
    with pytest.raises(ModelLoadError, match="holds Qwen2ForCausalLM, not a reward model"):
        _ppo(out, m, model=str(f["policy"]), reward_model=changed)

    # a loaded reference against the policy's folder, a reference folder against a loaded policy; the reward model
    # loaded twice (TRL's script): one folder
    second_reward = AutoModelForSequenceClassification.from_pretrained(f["reward"], num_labels=1)
    a = _ppo(tmp_path / "a", m, model=str(f["policy"]), ref_model=m["ref"], reward_model=m["reward"],
             value_model=second_reward)
    assert a.args.value_model_path == a.args.reward_model_path == str(tmp_path / "a" / "reward_model")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["reward_model"]
    # a causal LM value model (its backbone gets a new head): the policy's weights share base_model/, others written
    b = _ppo(tmp_path / "b", m, model=m["policy"], ref_model=str(f["policy"]), reward_model=str(f["reward"]),
             value_model=AutoModelForCausalLM.from_pretrained(f["policy"]))
    assert b.args.value_model_path == b.args.sft_model_path == str(tmp_path / "b" / "base_model")
    c = _ppo(tmp_path / "c", m, model=m["policy"], reward_model=str(f["reward"]), value_model=changed)
    assert c.args.value_model_path == str(tmp_path / "c" / "value_model")
    written = json.loads((tmp_path / "c" / "value_model" / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForCausalLM"]

    # a PeftModel policy: its adapters trained, its options taken; the reference must be its base
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(f["policy"])
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    d = _ppo(tmp_path / "d", m, model=model, ref_model=m["ref"], reward_model=str(f["reward"]))
    assert d.args.sft_model_path == str(tmp_path / "d" / "base_model" / "adapter")
    assert (d.args.use_peft, d.args.lora_r, d.args.lora_alpha) == (True, 2, 4)
    merged = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(f["policy"]), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with pytest.raises(ConfigError, match="q_proj.weight differs"):
        _ppo(tmp_path / "e", m, model=model, ref_model=merged.merge_and_unload(), reward_model=str(f["reward"]))
