"""Whole-trainer parity with TRL 1.12's `PPOTrainer`: the same tiny policy, reward and value models, prompts and
greedy sampling through `trl.experimental.ppo.PPOTrainer` (in a subprocess with `.venv-trl112` first on the path:
this file, run as a script, is that subprocess) and through `rloo_jax.PPOTrainer`, compared update by update.

- Same tokens on both sides: greedy decoding. TRL 1.12's PPO hard-codes sampling (`do_sample=True`): its module-level
  `generate` is replaced by the same call with `do_sample=False`, whose scores are the raw logits divided by
  `temperature + 1e-7`, as its sampling scores are (TRL reads its rollout log-probs from them). Here `top_k 1`,
  temperature 1: log-probs over the whole vocabulary at 1 + 1e-7. The completions of both sides are compared.
- Same prompts: TRL's DataLoader order (torch's `RandomSampler`, seeded by `args.seed`, nothing else drawing from
  torch's RNG with greedy decoding: `tests/test_ppo_math._trl_prompt_order`) is written into our dataset, read in
  file order (`shuffle_dataset false`).
- Same shuffles: `np.random.seed(seed)` before TRL's `train()`; here the micro-batch order comes from
  `np.random.RandomState(seed)`, the same stream.
- No end-of-dataloader update (accelerate then steps the optimizer after every micro-batch, docs/ppo.md): 3 prompt
  batches in the dataset, 2 updates (`total_episodes`).
- Compared: every logged PPO metric of both updates, and the final policy and value model weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.diffs import max_abs_diff, rel_diffs, tree_max_abs_diff

ROOT = Path(__file__).resolve().parents[1]
TRL112 = ROOT / ".venv-trl112"
VOCAB = ["<pad>", "<eos>"] + [f"w{i}" for i in range(46)]
PAD, EOS = 0, 1
UPDATES = 2
# TRL 1.12's logged names (the `eps` speed aside)
METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
           "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
           "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr",
           "episode")


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def build_models(root: str) -> dict[str, str]:
    """Tiny f32 Qwen2 policy, reward and value models (wide init: wide greedy margins) saved with the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    def cfg(**kw: Any) -> Qwen2Config:
        return Qwen2Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           initializer_range=0.3, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=False, **kw)

    paths = {}
    for name, cls, seed, kw in (("policy", Qwen2ForCausalLM, 0, {}),
                                ("reward", Qwen2ForSequenceClassification, 2, {"num_labels": 1}),
                                ("value", Qwen2ForSequenceClassification, 3, {"num_labels": 1})):
        torch.manual_seed(seed)
        path = os.path.join(root, name)
        cls(cfg(**kw)).save_pretrained(path)
        tokenizer().save_pretrained(path)
        paths[name] = path
    return paths


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 48, size=rng.integers(2, 6)).tolist() for _ in range(n)]


def trl_prompt_order(seed: int, n: int, local_batch_size: int, updates: int) -> list[list[int]]:
    """The rows TRL 1.12 feeds each update (one process, nothing else drawing from torch's RNG)."""
    from tests.test_ppo_math import _trl_prompt_order

    return _trl_prompt_order(seed, n, local_batch_size, updates)


# `"peft": True` in the options: the policy is `peft_policy(...)`, a PeftModel with non-zero adapters (LoRA on q/v,
# random A and B), whose reference in TRL 1.12 is the base with the adapters off (`disable_adapter()`)
PEFT = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def peft_policy(path: str) -> Any:
    """The causal LM at `path` as a peft PeftModel with non-zero adapters (seeded: the same for every call)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    return peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), peft.LoraConfig(**PEFT))


def local_batch_size(options: dict[str, Any]) -> int:
    return options["per_device_train_batch_size"] * options["gradient_accumulation_steps"]


# ----------------------------------------------------------------------------------------------- TRL 1.12's side
def run_trl(models: dict[str, str], out: str, options: dict[str, Any]) -> dict[str, Any]:
    """TRL 1.12's PPOTrainer in a subprocess: its log history, completions and final weights."""
    os.makedirs(out, exist_ok=True)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"models": models, "options": options}, f)
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1",
               PYTHONPATH=os.pathsep.join([str(TRL112), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(out, "trl.json")) as f:
        result = json.load(f)
    weights = np.load(os.path.join(out, "trl_weights.npz"))
    result["weights"] = {k: weights[k] for k in weights.files}
    return result


def _trl_driver(out: str) -> None:
    """Runs in the subprocess (TRL 1.12 first on sys.path)."""
    import types

    import torch
    import trl
    import trl.experimental.ppo.ppo_trainer as P
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    assert trl.__version__ == "1.12.0", (trl.__version__, trl.__file__)
    torch.set_num_threads(1)
    with open(os.path.join(out, "spec.json")) as f:
        spec = json.load(f)
    models, options = spec["models"], dict(spec["options"])
    with_peft = options.pop("peft", False)
    lbs = local_batch_size(options)
    tok = tokenizer()
    policy = peft_policy(models["policy"]) if with_peft else AutoModelForCausalLM.from_pretrained(models["policy"])
    ref = None if with_peft else AutoModelForCausalLM.from_pretrained(models["policy"])
    reward = AutoModelForSequenceClassification.from_pretrained(models["reward"], num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(models["value"], num_labels=1)
    args = PPOConfig(output_dir=os.path.join(out, "trl"), total_episodes=UPDATES * lbs, report_to=[], use_cpu=True,
                     num_sample_generations=0, save_strategy="no", logging_steps=1, disable_tqdm=True, **options)
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=Dataset.from_dict({"input_ids": prompts(3 * lbs)}))
    completions: list[list[list[int]]] = []

    def greedy_generate(lm_backbone, queries, pad_token_id, generation_config):  # P.generate, do_sample=False
        context_length = queries.shape[1]
        attention_mask = queries != pad_token_id
        input_ids = torch.masked_fill(queries, ~attention_mask, 0)
        config = generation_config.__class__(**generation_config.to_dict())
        config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
        output = lm_backbone.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                      return_dict_in_generate=True, output_logits=True)
        # the scores TRL's sampling path returns: the logits after its temperature warper (temperature + 1e-7)
        logits = torch.stack(output.logits, 1) / generation_config.temperature
        completions.append(output.sequences[:, context_length:].tolist())
        return torch.cat((queries, output.sequences[:, context_length:]), dim=1), logits

    P.generate = greedy_generate
    P.gc = types.SimpleNamespace(collect=lambda: 0)  # TRL collects garbage 3x per update: ~1 s each here
    np.random.seed(options["seed"])  # TRL's per-epoch np.random.permutation
    trainer.train()
    logs = [{k: float(v) for k, v in r.items() if isinstance(v, int | float)} for r in trainer.state.log_history]
    weights = {f"policy/{k}": v.detach().numpy() for k, v in policy.state_dict().items()}
    if with_peft:  # the trained adapters, by their adapter-file names (ours: final/adapter_model.safetensors)
        weights = {k.replace(".default.", "."): v for k, v in weights.items() if ".default." in k}
    weights.update({f"value/{k}": v.detach().numpy() for k, v in value.state_dict().items()})
    np.savez(os.path.join(out, "trl_weights.npz"), **weights)
    with open(os.path.join(out, "trl.json"), "w") as f:
        json.dump({"logs": logs, "completions": completions, "sync_gradients": None}, f)


# ----------------------------------------------------------------------------------------------- our side
def run_ours(models: dict[str, str], out: str, options: dict[str, Any]) -> dict[str, Any]:
    """rloo_jax's PPOTrainer on the same models, prompts in TRL's order, greedy sampling."""
    import datasets

    from rloo_jax import PPOConfig, PPOTrainer
    from rloo_jax.models.hf import TensorReader

    options = dict(options)
    with_peft = options.pop("peft", False)
    lbs = local_batch_size(options)
    rows = prompts(3 * lbs)
    order = [i for batch in trl_prompt_order(options["seed"], len(rows), lbs, UPDATES) for i in batch]
    rest = [i for i in range(len(rows)) if i not in order]
    data = datasets.Dataset.from_dict({"input_ids": [rows[i] for i in order + rest]})
    args = PPOConfig(output_dir=out, total_episodes=UPDATES * lbs, shuffle_dataset=False, top_k=1, bf16=False,
                     report_to="none", save_steps=1000, logging_steps=1, log_completions=True, **options)
    policy = peft_policy(models["policy"]) if with_peft else models["policy"]
    PPOTrainer(args=args, processing_class=None if not with_peft else tokenizer(), model=policy, ref_model=None,
               reward_model=models["reward"], train_dataset=data, value_model=models["value"]).train()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(out, "rollouts.jsonl")) as f:
        rollouts = [json.loads(line) for line in f]

    def weights(folder: str, prefix: str) -> dict[str, np.ndarray]:
        reader = TensorReader(Path(folder))
        return {f"{prefix}/{k}": np.asarray(reader.get(k)) for k in reader.names()}

    return {"records": records, "rollouts": rollouts,
            "weights": {**weights(os.path.join(out, "final"), "policy"),
                        **weights(os.path.join(out, "final_value"), "value")}}


def completion_texts(token_rows: list[list[int]], stop: int | None) -> list[str]:
    """TRL's responses as our rollout records show them: cut after the stop token, special tokens skipped."""
    texts = []
    for row in token_rows:
        if stop is not None and stop in row:
            row = row[: row.index(stop) + 1]
        texts.append(" ".join(VOCAB[t] for t in row if t not in (PAD, EOS)))
    return texts


def compare(theirs: dict[str, Any], ours: dict[str, Any], weights: str = "") -> dict[str, Any]:
    """The largest (absolute, relative) difference of each logged metric over the updates, and the largest weight
    difference over the weights whose names start with `weights` ("policy/", "value/"; "": all). A NaN on either
    side raises (tests/diffs.py; no compared metric or weight is NaN by design)."""
    trl_logs = [r for r in theirs["logs"] if "objective/kl" in r]
    our_logs = [r for r in ours["records"] if "objective/kl" in r]
    assert len(trl_logs) == len(our_logs) == UPDATES, (len(trl_logs), len(our_logs))
    metrics = {}
    for name in METRICS:
        a = [r[name] for r in trl_logs]
        b = [r[name] for r in our_logs]
        where = f"{name} over the updates (TRL vs ours)"
        metrics[name] = (max_abs_diff(a, b, where), float(rel_diffs(a, b, where).max()))
    common = sorted(set(theirs["weights"]) & set(ours["weights"]))
    assert len(common) == len(theirs["weights"]), sorted(set(theirs["weights"]) - set(ours["weights"]))
    chosen = [k for k in common if k.startswith(weights)]
    assert chosen, f"no weight named {weights}*"
    weight = tree_max_abs_diff({k: theirs["weights"][k] for k in chosen}, {k: ours["weights"][k] for k in chosen},
                               f"final weights {weights}* (TRL vs ours)")
    return {"metrics": metrics, "weights": weight}


if __name__ == "__main__":
    _trl_driver(sys.argv[1])
