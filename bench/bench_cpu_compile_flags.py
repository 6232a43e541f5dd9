"""XLA:CPU compile seconds of one tiny model's update program under several XLA_FLAGS, alternating rounds.

The test suite's cost is compiling tiny models' programs (BENCHMARKS.md, Sessions 13-14); this measures what the
suite's compile settings (tests/xla_flags.py) buy. Each (round, flags) runs in a fresh process: the model of
tests/test_step.py (Qwen2-shaped, 2 layers, D 32, V 40), RLOO with beta 0.1, 2 prompts of 6 tokens x 4
generations x 6 completion tokens; its update program is lowered once, then compiled, and the compile's CPU and
wall seconds are printed with the machine's load.

    .venv/bin/python bench/bench_cpu_compile_flags.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "XLA defaults": "",
    "LLVM -O0": "--xla_backend_optimization_level=0",
    "classic fusion emitters": "--xla_cpu_use_fusion_emitters=false",
    "both (the suite's)": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
}

CHILD = r'''
import json, time
import jax, jax.numpy as jnp, optax
from flax import nnx
import rloo_jax as rj
from rloo_jax.models import init_causal_lm
from rloo_jax.programs import Programs
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import StepConfig

jax.config.update("jax_default_matmul_precision", "highest")
tiny = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
graphdef, params = nnx.split(init_causal_lm(tiny, seed=0))
sampling = SamplingConfig(max_new_tokens=6, num_generations=4, temperature=0.9, eos_token_ids=(3,), pad_token_id=0)
programs = Programs(graphdef, optax.sgd(0.5), StepConfig(sampling=sampling, algorithm=rj.RLOO(beta=0.1)))
programs.init_state(params, params)
lowered = programs.update_program(2, 6, 6, 1).lower()
cpu, wall = time.process_time(), time.perf_counter()
compiled = lowered.compile()
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
print("RESULT " + json.dumps({"cpu_s": cpu, "wall_s": wall, "fusions": compiled.as_text().count(" fusion("),
                              "load": open("/proc/loadavg").read().split()[0]}))
'''


def run(flags: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, flags in SETTINGS.items():
            res = run(flags)
            results[name].append(res)
            print(f"round {r + 1} {name:26s} compile {res['cpu_s']:5.1f} CPU s, {res['wall_s']:5.1f} s wall, "
                  f"{res['fusions']} fusions, load {res['load']}", flush=True)
    print("\nmedian CPU s of the update program's compile:")
    for name, rs in results.items():
        cpu = sorted(x["cpu_s"] for x in rs)
        print(f"  {name:26s} {cpu[len(cpu) // 2]:5.1f} (range {cpu[0]:.1f}-{cpu[-1]:.1f})")


if __name__ == "__main__":
    main()
