"""Models handed over as torch objects (TRL 1.16 takes them): a transformers `PreTrainedModel` policy, a loaded reward
model in reward_funcs and a peft `PeftModel` train exactly as their saved folders do; their converted folders under
output_dir are what config.yaml names, a resume reuses them, and what we cannot take is refused clearly."""

import json

import jax
import ml_dtypes
import numpy as np
import peft
import pytest
import torch
import transformers
import yaml
from safetensors.numpy import load_file

import rloo_jax
from rloo_jax.errors import ConfigError
from rloo_jax.export import main as export_main
from rloo_jax.metrics import read_jsonl
from rloo_jax.models import ModelLoadError, check_checkpoint, load_causal_lm
from rloo_jax.models.hf import TensorReader
from rloo_jax.models.loaded import save_loaded
from rloo_jax.policy import check_adapter_options
from tests.checkpoints import build_tokenizer, qwen2_config

ROWS = [{"prompt": f"Count the letters of word number {i}:"} for i in range(16)]
SETTINGS = dict(
    per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_prompt_length=16, prompt_bucket=8,
    learning_rate=1e-2, lr_scheduler_type="constant", beta=0.05, seed=0, logging_steps=1, save_steps=1,
    compilation_cache=False,
)
TIMINGS = ("timing/sample", "timing/reference", "timing/reward", "timing/update", "step_time")


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def records(path):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in read_jsonl(path)]


def rewards_of(path):
    return [r["rewards"] for r in read_jsonl(path)] if path.is_file() else None


def tensors(folder, name="model.safetensors"):
    return load_file(str(folder / name))


def same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen2 policy and reward model built with transformers, and their saved folders (the reward model's
    folder is named `reward_model_0`, as the loaded one's, so the metric names agree)."""
    root = tmp_path_factory.mktemp("loaded")
    tok_dir = build_tokenizer(root / "tokenizer")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    policy = transformers.Qwen2ForCausalLM(qwen2_config(tied=True)).eval()
    policy.config._name_or_path = str(tok_dir)  # TRL reads the tokenizer from there when none is given
    torch.manual_seed(4)
    reward = transformers.Qwen2ForSequenceClassification(qwen2_config(tied=False, num_labels=1)).eval()
    reward.config._name_or_path = str(tok_dir)
    policy_dir, reward_dir = root / "policy", root / "saved" / "reward_model_0"
    for model, folder in ((policy, policy_dir), (reward, reward_dir)):
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return dict(policy=policy, reward=reward, policy_dir=policy_dir, reward_dir=reward_dir, tok=tok, tok_dir=tok_dir)


@pytest.mark.slow  # four short runs (2 + 2 steps, a resume to 3) and an export, each compiling: 132 s here
def test_loaded_policy_and_reward_model_train_as_their_folders(models, tmp_path, capsys):
    """RLOOTrainer(PreTrainedModel, [loaded reward model]) = RLOOTrainer(its folder, [the reward model's folder]):
    the same metrics.jsonl records (timings aside), rewards and final weights; config.yaml names the converted
    folders, which load; a second train() with the same objects resumes and leaves base_model/ as it was."""
    args = dict(max_steps=2, **SETTINGS)
    loaded = tmp_path / "loaded"
    trainer = rloo_jax.RLOOTrainer(models["policy"], [models["reward"]],
                                   args=rloo_jax.RLOOConfig(output_dir=str(loaded), **args), train_dataset=ROWS)
    trainer.train()
    folder = tmp_path / "folder"
    rloo_jax.RLOOTrainer(str(models["policy_dir"]), [str(models["reward_dir"])],
                         args=rloo_jax.RLOOConfig(output_dir=str(folder), **args), train_dataset=ROWS).train()
    got, expected = records(loaded / "metrics.jsonl"), records(folder / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2] and "rewards/reward_model_0/mean" in got[0]
    assert got == expected
    assert rewards_of(loaded / "rollouts.jsonl") == rewards_of(folder / "rollouts.jsonl")
    same_tensors(tensors(loaded / "final"), tensors(folder / "final"))
    assert not np.array_equal(tensors(loaded / "final")["model.embed_tokens.weight"],
                              tensors(models["policy_dir"])["model.embed_tokens.weight"])  # it trained

    config = yaml.safe_load((loaded / "config.yaml").read_text())
    assert config["model_name_or_path"] == str(loaded / "base_model")
    assert config["reward_funcs"] == [str(loaded / "reward_model_0")]
    load_causal_lm(config["model_name_or_path"])
    same_tensors(tensors(loaded / "base_model"), tensors(models["policy_dir"]))  # tied: no lm_head in either
    assert (loaded / "base_model" / "tokenizer.json").is_file()

    written = {p.name: p.stat().st_mtime_ns for p in (loaded / "base_model").iterdir()}
    capsys.readouterr()
    again = rloo_jax.RLOOTrainer(models["policy"], [models["reward"]], train_dataset=ROWS,
                                 args=rloo_jax.RLOOConfig(output_dir=str(loaded), **dict(args, max_steps=3)))
    again.train(resume_from_checkpoint=True)
    assert "Resuming from checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(loaded / "metrics.jsonl")] == [1, 2, 3]
    assert {p.name: p.stat().st_mtime_ns for p in (loaded / "base_model").iterdir()} == written
    assert export_main([str(loaded / "checkpoints" / "1"), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_model_is_written_as_transformers_writes_it(models, tmp_path, dtype):
    """save_loaded writes the tensors transformers' save_pretrained writes, bit for bit, in the model's dtype (bf16
    through float32, exact), under the same names (an untied LM head too); a second call with the same model
    writes nothing, another model is refused."""
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(qwen2_config(tied=False)).to(getattr(torch, dtype)).eval()
    model.save_pretrained(tmp_path / "hf")
    path, lora = save_loaded(model, tmp_path / "ours", "causal_lm", models["tok"])
    assert (path, lora) == (str(tmp_path / "ours"), {})
    theirs, ours = TensorReader(tmp_path / "hf"), TensorReader(tmp_path / "ours")
    assert ours.names() == theirs.names() and "lm_head.weight" in ours.names()
    for name in theirs.names():
        a, b = theirs.get(name), ours.get(name)
        assert a.dtype == b.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32), name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == dtype
    written = (tmp_path / "ours" / "model.safetensors").stat().st_mtime_ns
    assert save_loaded(model, tmp_path / "ours", "causal_lm", models["tok"])[0] == path
    assert (tmp_path / "ours" / "model.safetensors").stat().st_mtime_ns == written
    with pytest.raises(ModelLoadError, match="holds another model"):
        save_loaded(models["policy"], tmp_path / "ours", "causal_lm", models["tok"])


def test_first_difference_compares_weights_exactly(models):
    """`first_difference` (PPO's reference check): a tied model's state dict equals its folder (which leaves the LM
    head out) only when told the head is tied; one ulp apart in one tensor names that tensor; the same numbers held
    in bfloat16 and in float32 are equal."""
    from rloo_jax.models.loaded import StateDictReader, first_difference

    policy = models["policy"]  # tied
    ours, folder = StateDictReader(policy.state_dict()), TensorReader(models["policy_dir"])
    assert "lm_head.weight" in ours.names() and "lm_head.weight" not in folder.names()
    assert first_difference(ours, folder, tied_head=True) is None
    assert first_difference(ours, folder) == "lm_head.weight"
    copy = transformers.Qwen2ForCausalLM(qwen2_config(tied=True)).eval()
    copy.load_state_dict(policy.state_dict())
    with torch.no_grad():
        weight = copy.model.layers[1].self_attn.o_proj.weight
        weight[2, 3] = torch.nextafter(weight[2, 3], torch.tensor(float("inf")))
    assert first_difference(StateDictReader(copy.state_dict()), folder, tied_head=True) == \
        "model.layers.1.self_attn.o_proj.weight"
    half = copy.to(torch.bfloat16)
    assert first_difference(StateDictReader(half.state_dict()),
                            StateDictReader({k: v.float() for k, v in half.state_dict().items()})) is None


def _peft_model(models, **lora):
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(qwen2_config(tied=True)).eval()
    base.load_state_dict(models["policy"].state_dict())
    base.config._name_or_path = str(models["tok_dir"])
    options = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, peft.LoraConfig(**{**options, **lora}))


@pytest.mark.slow  # two 2-step LoRA runs, each compiling: 62 s on the loaded 2-core machine
def test_peft_model_trains_as_its_adapter_folder(models, tmp_path):
    """RLOOTrainer(PeftModel with non-zero adapters) = RLOOTrainer(those adapters saved as a PEFT adapter folder):
    the same records and final adapters; its LoRA options are read into config.yaml; final/ names the converted
    base."""
    model = _peft_model(models)
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(models["policy_dir"])
    (adapter_dir / "adapter_config.json").write_text(json.dumps(adapter_config))
    args = dict(max_steps=2, **SETTINGS)
    loaded, folder = tmp_path / "loaded", tmp_path / "folder"
    rloo_jax.RLOOTrainer(model, length_reward, args=rloo_jax.RLOOConfig(output_dir=str(loaded), **args),
                         train_dataset=ROWS).train()
    rloo_jax.RLOOTrainer(str(adapter_dir), length_reward, args=rloo_jax.RLOOConfig(output_dir=str(folder), **args),
                         train_dataset=ROWS).train()
    got, expected = records(loaded / "metrics.jsonl"), records(folder / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2] and got == expected
    # the reference is the base with a frozen copy of the starting adapters (TRL's): the first policy is the reference
    # (measured 9.4e-8: sampler vs training forward; then 0.081). The base with the adapters off gave 0.20, 0.34
    assert abs(got[0]["kl"]) < 1e-6 < got[1]["kl"]
    name = "adapter_model.safetensors"
    same_tensors(tensors(loaded / "final", name), tensors(folder / "final", name))
    start = tensors(loaded / "base_model" / "adapter", name)
    same_tensors(start, tensors(adapter_dir, name))  # the PeftModel's adapters, bit for bit, as peft writes them
    assert not np.array_equal(start[sorted(start)[0]], tensors(loaded / "final", name)[sorted(start)[0]])
    config = yaml.safe_load((loaded / "config.yaml").read_text())
    assert config["model_name_or_path"] == str(loaded / "base_model" / "adapter")
    assert (config["use_peft"], config["lora_r"], config["lora_alpha"], config["lora_dropout"]) == (True, 4, 8, 0.0)
    assert config["lora_target_modules"] == ["q_proj", "v_proj"]
    final = json.loads((loaded / "final" / "adapter_config.json").read_text())
    assert final["base_model_name_or_path"] == str(loaded / "base_model")
    # the CLI's options (args.use_peft set) are checked against the folder's, not replaced
    family = check_checkpoint(models["policy_dir"]).family
    mismatched = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "cli"), use_peft=True, lora_r=8,
                                     lora_target_modules=["q_proj", "v_proj"], lora_alpha=8, **args)
    with pytest.raises(ConfigError, match="holds LoRA r=4, alpha=8.0.*the run asks for r=8"):
        check_adapter_options(mismatched, family, str(adapter_dir))
    with pytest.raises(ConfigError, match="is a PEFT adapter folder: set use_peft"):
        check_adapter_options(rloo_jax.RLOOConfig(output_dir=str(tmp_path / "cli"), **args), family, str(adapter_dir))


def test_the_reference_of_given_adapters_follows_each_trl(models, tmp_path):
    """Given adapters (a PEFT adapter folder, as a PeftModel is written): RLOO / GRPO (TRL 1.16) keep a frozen copy
    of them as the reference (their "ref" adapter), PPO (TRL 1.12) the base with the adapters off (no copy); new
    adapters and beta 0 keep none."""
    from rloo_jax.policy import policy

    adapter_dir = tmp_path / "adapter"
    _peft_model(models).save_pretrained(adapter_dir)
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])
    base = load_causal_lm(models["policy_dir"])
    rloo = policy(rloo_jax.RLOOConfig(output_dir=str(tmp_path), beta=0.05, **lora), base, str(adapter_dir))
    assert jax.tree.structure(rloo.ref_params) == jax.tree.structure(rloo.params)
    for a, b in zip(jax.tree.leaves(rloo.ref_params), jax.tree.leaves(rloo.params), strict=True):
        assert a is not b and np.array_equal(np.asarray(a), np.asarray(b)) and np.abs(np.asarray(a)).max() > 0
    assert policy(rloo_jax.RLOOConfig(output_dir=str(tmp_path), beta=0.0, **lora), base,
                  str(adapter_dir)).ref_params is None
    assert policy(rloo_jax.RLOOConfig(output_dir=str(tmp_path), beta=0.05, **lora), base).ref_params is None
    assert policy(rloo_jax.PPOConfig(output_dir=str(tmp_path), **lora), base, str(adapter_dir)).ref_params is None


def test_what_is_refused(models, tmp_path):
    """A torch module that is no PreTrainedModel, an unsupported architecture (the folder's ModelLoadError), LoRA
    variants we do not compute, a PeftModel with a peft_config, a missing tokenizer, a reward model that is none and
    another model in an output_dir started from one: each a clear error, before any training."""
    args = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "run"), max_steps=1, **SETTINGS)

    def make(model, reward=length_reward, **kw):
        return rloo_jax.RLOOTrainer(model, reward, args=args, train_dataset=ROWS, **kw)

    with pytest.raises(ConfigError, match="not a transformers PreTrainedModel"):
        make(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="reward_funcs\\[0\\] is a Linear"):
        make(str(models["policy_dir"]), torch.nn.Linear(2, 2))

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=280))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelLoadError) as from_folder:
        make(str(tmp_path / "gpt2"))
    with pytest.raises(ModelLoadError) as from_object:
        make(gpt2, processing_class=models["tok"])
    assert "unsupported architecture 'GPT2LMHeadModel'; supported:" in str(from_object.value)
    assert str(from_object.value) == str(from_folder.value)
    with pytest.raises(ModelLoadError, match="holds Qwen2ForCausalLM, not a reward model"):
        make(str(models["policy_dir"]), models["policy"])

    for lora, what in ((dict(use_dora=True), "use_dora=True"), (dict(bias="all"), "bias='all'"),
                       (dict(modules_to_save=["lm_head"]), "modules_to_save")):
        with pytest.raises(ConfigError, match=what):
            make(_peft_model(models, **lora))
    with pytest.raises(ModelLoadError, match="lora_target_modules: lm_head is not a projection"):
        make(_peft_model(models, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="together with a peft_config"):
        make(_peft_model(models), peft_config=peft.LoraConfig(r=2))

    nameless = transformers.Qwen2ForCausalLM(qwen2_config(tied=True))
    with pytest.raises(ConfigError, match="no tokenizer for the loaded model .*processing_class"):
        make(nameless)
    assert not (tmp_path / "run" / "base_model").exists()  # nothing written by a refused model

    make(models["policy"])  # writes run/base_model
    other = transformers.Qwen2ForCausalLM(qwen2_config(tied=True))
    with pytest.raises(ModelLoadError, match="base_model holds another model"):
        make(other, processing_class=models["tok"])


def test_grpo_trainer_takes_them_too(models, tmp_path):
    """GRPOTrainer shares the constructor: a loaded policy and reward model become folders under output_dir, named
    by its args (no training here: the runs above cover it)."""
    args = rloo_jax.GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, **SETTINGS)
    trainer = rloo_jax.GRPOTrainer(models["policy"], [length_reward, models["reward"]], args=args, train_dataset=ROWS)
    assert trainer.args.model_name_or_path == str(tmp_path / "grpo" / "base_model")
    assert trainer.args.reward_funcs[1] == str(tmp_path / "grpo" / "reward_model_1")
    assert trainer.processing_class.pad_token == "<pad>" and trainer.processing_class.padding_side == "left"
    assert type(trainer.reward_funcs[1]).__name__ == "RewardModel"
