"""tunix's RLOO on the bench checkpoint: seconds per step, run inside the tunix venv (bench_protocol.py builds it).

tunix (google/tunix) builds its own Flax NNX Qwen2 from the config values and the safetensors file
(`tunix.models.qwen2.params.create_model_from_safe_tensors`); the GRPO learner with `advantage_estimator="rloo"`
is its RLOO. Same checkpoint, tokenizer, prompts, reward and settings as bench_rloo_step.py: G = 4, 2 prompts
(8 completions) per optimizer step, 32 new tokens, temperature 1, beta = 0.05 (reference model on), AdamW lr 1e-5
with global-norm clip 1.0, float32, one mini-batch and one iteration per generation. tunix puts the KL penalty in
the loss (TRL and rloo_jax: in the reward); the work per step is the same (a reference forward per completion).

    bench/.venv-tunix/bin/python bench/tunix_rloo.py MODEL_DIR PROMPTS_JSONL [--steps 11] [--remat]

Prints `RESULT {"times": [s, ...], "versions": {...}}`: the wall time of each global step (generation, reference
log-probs, reward, advantages and the update; the actor's parameters are waited for before the clock stops).
"""

import argparse
import json
import os
import sys
import time
from importlib import metadata

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_rloo_step import SETTINGS, reward  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from tunix.models.qwen2 import model as qwen2_lib  # noqa: E402
from tunix.models.qwen2 import params as qwen2_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

PROMPTS_PER_STEP = SETTINGS["per_device_train_batch_size"] // SETTINGS["num_generations"]
PROMPT_LENGTH = 32


def model_config(model_dir: str, remat: bool) -> qwen2_lib.ModelConfig:
    """tunix's Qwen2 config from the Hugging Face config.json of the bench checkpoint."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    rope = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    return qwen2_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope), norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
        remat_config=qwen2_lib.RematConfig.BLOCK if remat else qwen2_lib.RematConfig.NONE)


def prompt_batches(path: str, steps: int) -> list[dict]:
    """The bench prompts in file order, PROMPTS_PER_STEP per batch (the same prompts every trainer sees)."""
    with open(path) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    n = PROMPTS_PER_STEP
    # one array per batch: tunix maps np.repeat over the batch's leaves, and a list's leaves are its strings
    return [{"prompts": np.asarray(prompts[i * n:(i + 1) * n])} for i in range(steps)]


def cluster(model_dir: str, steps: int, remat: bool) -> tuple[rl_cluster_lib.RLCluster, nnx.Module]:
    """An RLCluster with actor, rollout and reference on one single-device mesh (colocated, as on one CPU)."""
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    cfg = model_config(model_dir, remat)
    actor = qwen2_params.create_model_from_safe_tensors(model_dir, cfg, mesh)
    reference = qwen2_params.create_model_from_safe_tensors(model_dir, cfg, mesh)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(SETTINGS["learning_rate"], weight_decay=0.0))
    roles = rl_cluster_lib.Role
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10 * steps,
                                                        max_steps=steps),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=SETTINGS["max_completion_length"], temperature=SETTINGS["temperature"],
            top_p=1.0, top_k=None, max_prompt_length=PROMPT_LENGTH,
            kv_cache_size=PROMPT_LENGTH + SETTINGS["max_completion_length"] + 8))
    rl = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=config)
    return rl, actor


def timed(fn, actor: nnx.Module, times: list[float]):
    """fn, with its wall time (until the actor's parameters are ready) appended to times."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        jax.block_until_ready(nnx.state(actor, nnx.Param))
        times.append(time.perf_counter() - t0)
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--remat", action="store_true",
                    help="rematerialise each block (RematConfig.BLOCK; tunix 0.1.7 fails with flax 0.12.8)")
    args = ap.parse_args()
    rl, actor = cluster(args.model_dir, args.steps, args.remat)
    algo = grpo_learner.GRPOConfig(num_generations=SETTINGS["num_generations"], num_iterations=1,
                                   beta=SETTINGS["beta"], epsilon=0.2, advantage_estimator="rloo")
    learner = grpo_learner.GRPOLearner(rl_cluster=rl, algo_config=algo, reward_fns=reward)
    times: list[float] = []
    learner._run_global_step = timed(learner._run_global_step, actor, times)
    learner.train(prompt_batches(args.data, args.steps))
    versions = {name: metadata.version(name) for name in ("google-tunix", "jax", "flax", "transformers")}
    print("RESULT", json.dumps({"times": times, "versions": versions}), flush=True)


if __name__ == "__main__":
    main()
