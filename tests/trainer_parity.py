"""Whole-trainer parity with TRL 1.16: the same tiny model, prompts and rewards through `trl.GRPOTrainer` /
`trl.RLOOTrainer` and through `rloo_jax.GRPOTrainer` / `RLOOTrainer`, compared record by record (DESIGN.md section 7).

- Same tokens on both sides: greedy sampling (top_k 1, temperature 1: log-probs over the full vocabulary at T=1),
  every sampled token's greedy margin checked well above float noise, and the completions compared.
- Non-zero gradients: greedy gives a prompt's G completions the same tokens and group-centred advantages sum to 0,
  so a step holding whole groups has no policy gradient: off-policy runs give each optimizer step half a group
  (per_device_train_batch_size 2, G 4, steps_per_generation 4), and the reward varies with the position in the
  generation batch. On-policy runs get their gradient from the KL term and the entropy bonus.
- Order: TRL shuffles the generation batch before cutting it into optimizer steps (torch's RNG); here the order is
  kept, so TRL's shuffle is made the identity. Prompts are read in file order on both sides (shuffle_dataset false).

`run_pair(kind, tmp, **options)` returns both sides' per-step records (`log_history`), completions and final
weights; `compare(...)` the largest differences. Used by tests/test_trainer_parity.py (a few configurations in CI)
and bench/bench_trl_parity.py (every loss type, on and off policy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.diffs import abs_diffs, rel_diffs, tree_max_abs_diff

VOCAB = ["<pad>", "<eos>"] + [f"w{i}" for i in range(62)]
PAD, EOS = 0, 1
PROMPTS = ["w3 w4 w5 w6", "w10 w2", "w7 w7 w30", "w41 w9 w12 w13 w14", "w20", "w33 w34"]
G, C = 4, 6
# per-step metrics both log with the same meaning (TRL's names)
METRICS = ("loss", "grad_norm", "learning_rate", "kl", "entropy", "reward", "reward_std", "frac_reward_zero_std",
           "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
           "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss", "entropy_coef",
           "completions/mean_length", "completions/min_length", "completions/max_length",
           "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length", "rewards/position_reward/mean", "rewards/position_reward/std")


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def build_model(path: str, seed: int = 0) -> str:
    """A tiny random Qwen2 (f32) saved to `path` with its tokenizer; large init so greedy margins are wide."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, pad_token_id=PAD,
        eos_token_id=EOS, tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def position_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                    by_position: bool = True, **kwargs: Any) -> list[float]:
    """A reward that differs inside a group of identical (greedy) completions: the row's position in the
    generation batch, plus the completion's length (so the policy's own output matters too). `by_position` false:
    the completion's alone, equal within a group, so group-centred advantages are exactly 0 (on-policy runs: no
    policy gradient whose float-noise residue Adam would blow up to learning-rate-sized steps)."""
    return [0.25 * (i % G) * by_position + 0.1 * len(ids) + 0.05 * (sum(ids) % 7)
            for i, ids in enumerate(completion_ids)]


# LoRA on q/v with random A and B (peft's init_lora_weights=False): a PeftModel whose adapters start non-zero
PEFT = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def peft_policy(model: str) -> Any:
    """The model at `model` as a peft PeftModel with non-zero adapters (the same for every call: seeded)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    return peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model), peft.LoraConfig(**PEFT))


def _adapters(named: dict[str, Any]) -> dict[str, Any]:
    """A PeftModel's trained adapters by their adapter-file names (`...lora_A.weight`; TRL's frozen "ref" copy
    and the base left out)."""
    return {k.replace(".default.", "."): v for k, v in named.items() if ".default." in k}


def _common(out: str, **options: Any) -> dict[str, Any]:
    base = dict(
        output_dir=out, per_device_train_batch_size=2, num_generations=G, max_completion_length=C, top_k=1,
        temperature=1.0, learning_rate=5e-3, max_steps=8, logging_steps=1, seed=0, shuffle_dataset=False,
        bf16=False, report_to="none", save_steps=1000, max_grad_norm=1.0, lr_scheduler_type="linear",
        steps_per_generation=4, gradient_accumulation_steps=1,
    )
    base.update(options)
    return base


def run_trl(kind: str, model: str, out: str, by_position: bool = True, peft_model: bool = False,
            **options: Any) -> dict[str, Any]:
    """TRL 1.16's trainer `kind` (rloo, grpo) on CPU with its generation-batch shuffle made the identity.
    `peft_model`: the policy is `peft_policy(model)`, and the weights compared are its adapters."""
    import datasets
    import torch
    import trl
    from trl.trainer import grpo_trainer, rloo_trainer

    seen: list[list[int]] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return position_reward(prompts, completions, completion_ids, by_position)

    reward.__name__ = "position_reward"
    cfg_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    args = cfg_cls(**{**_common(out, **options), "report_to": []}, use_cpu=True)
    module = grpo_trainer if kind == "grpo" else rloo_trainer
    keep = module.shuffle_sequence_dict
    module.shuffle_sequence_dict = lambda d: d  # our order: the generation batch as generated
    try:
        torch.manual_seed(0)
        policy = peft_policy(model) if peft_model else model
        torch.manual_seed(0)
        trainer = trainer_cls(model=policy, reward_funcs=[reward], args=args, processing_class=tokenizer(),
                              train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}))
        trainer.train()
    finally:
        module.shuffle_sequence_dict = keep
    weights = {name: p.detach().numpy().copy() for name, p in trainer.model.named_parameters()}
    if peft_model:
        weights = _adapters(weights)
    records = [r for r in trainer.state.log_history if "loss" in r]
    return {"records": records, "completions": seen, "weights": weights}


def run_ours(kind: str, model: str, out: str, by_position: bool = True, peft_model: bool = False,
             ours: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """rloo_jax's trainer `kind` on the same run (float32 on CPU); `ours`: options of this side only (e.g. the
    per-device batch on a mesh)."""
    import datasets
    from safetensors.numpy import load_file

    import rloo_jax as rj

    seen: list[list[int]] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return position_reward(prompts, completions, completion_ids, by_position)

    reward.__name__ = "position_reward"
    cfg_cls, trainer_cls = (rj.GRPOConfig, rj.GRPOTrainer) if kind == "grpo" else (rj.RLOOConfig, rj.RLOOTrainer)
    trainer = trainer_cls(model=peft_policy(model) if peft_model else model, reward_funcs=[reward],
                          args=cfg_cls(**{**_common(out, **options), **(ours or {})}),
                          processing_class=tokenizer(),
                          train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    # float32 checkpoint: exported as is (LoRA: the adapters, as a PEFT adapter folder)
    weights = load_file(os.path.join(out, "final", "adapter_model.safetensors" if peft_model else "model.safetensors"))
    return {"records": records, "completions": seen, "weights": weights}


def compare(trl_run: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The largest absolute / relative differences of every compared metric over the steps, and of the final
    weights (by Hugging Face name); raises if the two runs sampled different tokens or logged other steps, or if
    either side holds a NaN where the other does not (or both do: no compared metric is NaN by design)."""
    assert trl_run["completions"] == ours["completions"], "the two trainers sampled different completions"
    theirs, mine = trl_run["records"], ours["records"]
    assert [r["step"] for r in theirs] == [r["step"] for r in mine], ([r["step"] for r in theirs],
                                                                      [r["step"] for r in mine])
    diffs: dict[str, tuple[float, float]] = {}
    for a, b in zip(theirs, mine, strict=True):
        for name in METRICS:
            if name not in a and name not in b:
                continue
            assert (name in a) == (name in b), f"step {a['step']}: {name} logged by one side only"
            x, y = a[name], b[name]
            if x is None or y is None:
                assert x is None and y is None, (a["step"], name, x, y)
                continue
            # NaN on either side fails (tests/diffs.py): max(0.0, nan) is 0.0, so a NaN would otherwise count as equal
            where = f"step {a['step']} {name} (TRL vs ours)"
            d, r = float(abs_diffs(x, y, where)), float(rel_diffs(x, y, where))
            old = diffs.get(name, (0.0, 0.0))
            diffs[name] = (max(old[0], d), max(old[1], r))
    weights = tree_max_abs_diff(trl_run["weights"], ours["weights"], "final weights (TRL vs ours)")
    return {"metrics": diffs, "weights": weights, "steps": len(theirs)}


def run_ours_on_devices(devices: int, kind: str, model: str, out: str, **options: Any) -> dict[str, Any]:
    """`run_ours` in a subprocess with `devices` forced CPU devices (XLA_FLAGS must be set before JAX starts; this
    file, run as a script, is that subprocess): its records, completions and final weights."""
    import numpy as np

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "spec.json"), "w") as f:
        json.dump({"kind": kind, "model": model, "options": options}, f)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), out], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    assert result["devices"] == devices, result["devices"]
    weights = np.load(os.path.join(out, "weights.npz"))
    result["weights"] = {k: weights[k] for k in weights.files}
    return result


def _ours_driver(out: str) -> None:
    """Runs in the subprocess of `run_ours_on_devices`."""
    import jax
    import numpy as np

    with open(os.path.join(out, "spec.json")) as f:
        spec = json.load(f)
    result = run_ours(spec["kind"], spec["model"], os.path.join(out, "run"), **spec["options"])
    np.savez(os.path.join(out, "weights.npz"), **result.pop("weights"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(dict(result, devices=jax.device_count()), f)


if __name__ == "__main__":
    _ours_driver(sys.argv[1])
