"""`python -m rloo_jax.export`: an intermediate checkpoint as a Hugging Face folder (bf16, sharded, PEFT), loaded by
transformers / peft with our logits; the trainer's final/ is the same export; errors are one line, exit 2."""

import json
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rloo_jax import demo
from rloo_jax.cli import main
from rloo_jax.export import load_policy, read_checkpoint
from rloo_jax.export import main as export_main
from rloo_jax.models import load_causal_lm

pytestmark = pytest.mark.slow  # the module's two training runs (the fixture) take ~30-60 s on this CPU

# the demo, shrunk (8 prompts x G=4, 8-token completions), 2 steps with a checkpoint after each; a large learning
# rate moves the weights well away from the base, so an export of the wrong step (or of the base) would show
RUN = ["--dataset_name", "demo", "--reward_funcs", "rloo_jax.demo:letters_reward", "--max_steps", "2",
       "--save_steps", "1", "--logging_steps", "1", "--learning_rate", "0.01", "--per_device_train_batch_size", "32",
       "--num_generations", "4", "--max_completion_length", "8", "--eval_steps", "None", "--compilation_cache",
       "false"]  # fmt: skip


X = len(demo.SPECIAL_TOKENS) + demo.CHARACTERS.index("x")  # the id of "x" in the demo tokenizer
BASE_GENERATION = {"bos_token_id": 3, "eos_token_id": [1, X], "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                   "transformers_version": "4.51.0"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full fine-tune of a bfloat16 base (the demo policy saved by transformers in bfloat16) and a LoRA run on
    the float32 demo policy; both keep checkpoints 1 and 2."""
    d = tmp_path_factory.mktemp("export_runs")
    f32 = demo.prepare_model(d / "demo", seed=0)
    transformers.AutoModelForCausalLM.from_pretrained(f32).to(torch.bfloat16).save_pretrained(d / "bf16")
    demo.build_tokenizer().save_pretrained(d / "bf16")
    # a second EOS (the token of "x") and the base's own sampling defaults, which the exports must replace
    (d / "bf16" / "generation_config.json").write_text(json.dumps(BASE_GENERATION))
    assert json.loads((d / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert main([*RUN, "--model_name_or_path", str(d / "bf16"), "--output_dir", str(d / "full")]) == 0
    assert main([*RUN, "--model_name_or_path", f32, "--output_dir", str(d / "lora"), "--use_peft",
                 "--lora_target_modules", "all-linear", "--lora_r", "4", "--merge_adapter_on_export"]) == 0
    return d


def batch():
    ids = np.random.RandomState(0).randint(3, demo.MODEL_CONFIG["vocab_size"], size=(2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def ours(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))


def theirs(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long())
    return out.logits.float().numpy()


def hf_load(path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def safetensors_dtypes(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def rounded_to_bf16(model):
    """Our model with every parameter rounded to bfloat16 and back (what a bfloat16 export holds), float32 compute."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, nnx.map_state(lambda _, x: jnp.asarray(x).astype(jnp.bfloat16).astype(x.dtype),
                                             state))


@pytest.mark.parity
def test_intermediate_checkpoint_exports_bf16_and_loads_in_transformers(runs, tmp_path, capsys):
    out = tmp_path / "step1"
    assert export_main([str(runs / "full" / "checkpoints" / "1"), str(out)]) == 0  # dtype auto: the base's bf16
    assert "Exported step 1 of" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert safetensors_dtypes(out / "model.safetensors") == {"BF16"}
    assert (out / "tokenizer.json").is_file()
    model, _ = load_policy(read_checkpoint(str(runs / "full" / "checkpoints" / "1")))  # float32 master weights
    step2, _ = load_policy(read_checkpoint(str(runs / "full" / "checkpoints" / "2")))
    ids, mask = batch()
    mine = ours(model, ids, mask)
    assert np.abs(mine - ours(step2, ids, mask))[mask == 1].max() > 1e-2  # steps 1 and 2 really differ
    # the same function: transformers reading the bf16 weights into float32 = our weights rounded to bf16, both in
    # float32. Measured <= 1.7e-5 (this batch and four 4x24-token ones; logits |max| ~6: summation order only)
    exact = np.abs(theirs(hf_load(out, dtype=torch.float32), ids, mask) - ours(rounded_to_bf16(model), ids, mask))
    assert exact[mask == 1].max() <= 5e-5
    # transformers' own bfloat16 (weights and compute) against our float32 master weights: the bf16 tolerance.
    # Measured max |diff| 0.11 on this batch, 0.19-0.28 on four 4x24-token batches (logits std 1.6, |max| 6-7; a
    # bf16 step at 4-8 is 0.03): rounding the weights alone gives 0.11-0.14, bf16 compute alone 0.16-0.23
    hf = hf_load(out)  # dtype from config.json
    assert next(hf.parameters()).dtype == torch.bfloat16
    bf16 = np.abs(theirs(hf, ids, mask) - mine)[mask == 1].max()
    print(f"transformers bf16 vs ours f32: max abs diff {bf16:.4f}, logits max {np.abs(mine).max():.2f}")
    assert bf16 <= 0.3
    # our own loader reads the export back: the bf16-rounded weights
    back = load_causal_lm(out)
    assert np.abs(ours(back, ids, mask) - ours(rounded_to_bf16(model), ids, mask))[mask == 1].max() <= 1e-5


def test_final_is_the_export_of_the_last_checkpoint(runs, tmp_path):
    """The trainer's final/ goes through the same code: export_dtype auto (bf16 here), the same bytes."""
    assert export_main([str(runs / "full"), str(tmp_path / "last")]) == 0  # <output_dir>: its newest step, 2
    final = runs / "full" / "final"
    assert (tmp_path / "last" / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert export_main([str(runs / "full"), str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    assert safetensors_dtypes(tmp_path / "f32" / "model.safetensors") == {"F32"}
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parity
def test_sharded_export_has_transformers_index_and_loads(runs, tmp_path):
    ckpt = str(runs / "full" / "checkpoints" / "1")
    assert export_main([ckpt, str(tmp_path / "one")]) == 0
    assert export_main([ckpt, str(tmp_path / "sharded"), "--max_shard_size", "60KB"]) == 0  # ~155 KB of bf16
    files = sorted(p.name for p in (tmp_path / "sharded").glob("model*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    single = hf_load(tmp_path / "one")
    assert set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(single.state_dict()) - {"lm_head.weight"}  # tied head: not stored
    total = sum(2 * p.numel() for n, p in single.state_dict().items() if n != "lm_head.weight")
    assert index["metadata"] == {"total_size": total, "total_parameters": total // 2}
    # transformers writes the same index format for the same model and shard size
    single.save_pretrained(tmp_path / "theirs", max_shard_size="60KB")
    their_index = json.loads((tmp_path / "theirs" / "model.safetensors.index.json").read_text())
    assert set(their_index) == set(index) and set(their_index["metadata"]) == set(index["metadata"])
    assert their_index["metadata"]["total_size"] == total
    ids, mask = batch()
    sharded = theirs(hf_load(tmp_path / "sharded"), ids, mask)
    assert np.array_equal(sharded, theirs(single, ids, mask))
    assert np.abs(ours(load_causal_lm(tmp_path / "sharded"), ids, mask) - ours(load_causal_lm(tmp_path / "one"),
                                                                                 ids, mask)).max() == 0
    # a second export into the same folder, unsharded, leaves no stale shard behind
    assert export_main([ckpt, str(tmp_path / "sharded")]) == 0
    assert sorted(p.name for p in (tmp_path / "sharded").glob("model*")) == ["model.safetensors"]


@pytest.mark.parity
def test_lora_checkpoint_exports_a_peft_adapter_and_a_merged_model(runs, tmp_path):
    import peft

    ckpt = str(runs / "lora" / "checkpoints" / "1")
    assert export_main([ckpt, str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and len(config["target_modules"]) == 7
    assert safetensors_dtypes(tmp_path / "adapter" / "adapter_model.safetensors") == {"F32"}  # a float32 base
    model, base_dir = load_policy(read_checkpoint(ckpt))
    assert config["base_model_name_or_path"] == base_dir
    ids, mask = batch()
    mine = ours(model, ids, mask)
    base = ours(load_causal_lm(base_dir), ids, mask)
    assert np.abs(mine - base)[mask == 1].max() > 1e-3  # the adapters of step 1 are not zero
    with_peft = peft.PeftModel.from_pretrained(hf_load(base_dir), tmp_path / "adapter").eval()
    assert np.abs(theirs(with_peft, ids, mask) - mine)[mask == 1].max() <= 1e-4  # float32, as tests/test_lora.py
    assert export_main([ckpt, str(tmp_path / "merged"), "--merged"]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert np.abs(theirs(hf_load(tmp_path / "merged"), ids, mask) - mine)[mask == 1].max() <= 1e-4
    # the trainer's final/ and final_merged/ are these exports of its last checkpoint
    assert export_main([str(runs / "lora"), str(tmp_path / "last")]) == 0
    name = "adapter_model.safetensors"
    assert (tmp_path / "last" / name).read_bytes() == (runs / "lora" / "final" / name).read_bytes()
    assert export_main([str(runs / "lora"), str(tmp_path / "last_merged"), "--merged"]) == 0
    assert (tmp_path / "last_merged" / "model.safetensors").read_bytes() == (
        runs / "lora" / "final_merged" / "model.safetensors").read_bytes()


def test_export_errors_exit_2_with_one_line(runs, tmp_path, capsys):
    full = runs / "full"
    no_config = tmp_path / "copied"
    shutil.copytree(full / "checkpoints", no_config / "checkpoints")
    cases = [
        ([str(tmp_path / "nowhere"), str(tmp_path / "o")], "is not a checkpoint"),
        ([str(runs), str(tmp_path / "o")], "is not a checkpoint"),
        ([str(full / "checkpoints" / "9"), str(tmp_path / "o")], "is incomplete (complete steps: 1, 2)"),
        ([str(no_config / "checkpoints" / "1"), str(tmp_path / "o")], "has no config.yaml next to checkpoints/"),
        ([str(full), str(tmp_path / "o"), "--merged"], "--merged folds LoRA adapters"),
        ([str(full), str(tmp_path / "o"), "--dtype", "int8"], "argument --dtype: invalid choice"),
        ([str(full), str(tmp_path / "o"), "--max_shard_size", "lots"], "max_shard_size 'lots'"),
        ([str(full)], "the following arguments are required: out_dir"),
    ]
    for argv, message in cases:
        assert export_main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and message in err, (argv, err)
    assert not (tmp_path / "o").exists()


def test_push_to_hub_without_a_network_is_one_clear_error(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert export_main([str(runs / "full"), str(tmp_path / "o"), "--push_to_hub", "someone/model"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --push_to_hub someone/model: the upload failed (")
    assert "the export itself is complete" in err[0]
    assert (tmp_path / "o" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------ generation_config
def test_generation_config_goldens():
    from rloo_jax.models.export import generation_config

    sampling = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0,
                "max_completion_length": 8}
    assert generation_config([1], 0, sampling) == {
        "eos_token_id": [1], "pad_token_id": 0, "max_new_tokens": 8, "do_sample": True, "temperature": 0.7,
        "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
    # the base's other fields kept, its sampling defaults replaced; min_p written when set
    got = generation_config([1, 7], 0, {**sampling, "top_k": 5, "min_p": 0.1}, BASE_GENERATION)
    assert got == {"bos_token_id": 3, "eos_token_id": [1, 7], "pad_token_id": 0, "max_new_tokens": 8,
                   "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 1.0, "repetition_penalty": 1.0,
                   "min_p": 0.1}
    # greedy (temperature 0): no sampling fields at all, the base's removed too
    assert generation_config([1, 7], 0, {**sampling, "temperature": 0.0}, BASE_GENERATION) == {
        "bos_token_id": 3, "eos_token_id": [1, 7], "pad_token_id": 0, "max_new_tokens": 8, "do_sample": False,
        "repetition_penalty": 1.0}


def test_every_export_has_generation_config_and_tokenizer(runs, tmp_path):
    """final/, final_merged/ and every `python -m rloo_jax.export` folder (full, PEFT adapter, merged) carry the
    run's EOS ids (the tokenizer's and the base's extra one), pad id and sampling options in a
    generation_config.json that transformers reads, and the tokenizer."""
    full = str(runs / "full" / "checkpoints" / "1")
    lora = str(runs / "lora" / "checkpoints" / "1")
    assert export_main([full, str(tmp_path / "full")]) == 0
    assert export_main([lora, str(tmp_path / "adapter")]) == 0
    assert export_main([lora, str(tmp_path / "merged"), "--merged"]) == 0
    run = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
           "max_new_tokens": 8, "pad_token_id": 0}  # the demo config's sampling, max_completion_length 8 (RUN)
    folders = {runs / "full" / "final": [1, X], tmp_path / "full": [1, X], runs / "lora" / "final": [1],
               runs / "lora" / "final_merged": [1], tmp_path / "adapter": [1], tmp_path / "merged": [1]}
    for folder, eos in folders.items():
        written = json.loads((folder / "generation_config.json").read_text())
        assert written == {**run, "eos_token_id": eos, **({"bos_token_id": 3} if len(eos) == 2 else {})}, folder
        loaded = transformers.GenerationConfig.from_pretrained(folder)
        assert (loaded.eos_token_id, loaded.pad_token_id, loaded.do_sample, loaded.temperature, loaded.top_k,
                loaded.top_p, loaded.max_new_tokens) == (eos, 0, True, 1.0, 0, 1.0, 8), folder
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert tokenizer("ace", add_special_tokens=False)["input_ids"] == demo.build_tokenizer()(
            "ace", add_special_tokens=False)["input_ids"], folder
    # what generate() does with it: the policy stops at the base's extra EOS too
    hf = hf_load(runs / "full" / "final")
    assert hf.generation_config.eos_token_id == [1, X] and hf.generation_config.top_k == 0
