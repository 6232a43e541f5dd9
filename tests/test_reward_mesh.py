"""Reward models sharded like the policy: the sharded scorer gives the unsharded scores (8 forced CPU devices, and
two processes of 4 that each score their own rows), its weights are really split, and compiled for TPU slices its
per-chip memory falls with the slice size.

As in tests/test_mesh.py, what needs several devices runs in subprocesses (XLA_FLAGS must be set before jax is
imported; other test modules import jax first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rloo_jax import demo
from rloo_jax.models import init_reward_model, save_pretrained
from tests.xla_flags import forced_devices

pytestmark = pytest.mark.slow  # three JAX processes (~30-60 s), and two TPU compiles
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240

# `python -c WORKER RM_DIR compare` (one process, 8 devices) or `WORKER RM_DIR process PORT ID` (one of two processes,
# 4 devices each). Prints one JSON line.
WORKER = r'''
import json, sys
import jax, numpy as np
folder, mode = sys.argv[1], sys.argv[2]
if mode == "process":
    from rloo_jax.mesh import initialize_distributed
    initialize_distributed(f"127.0.0.1:{sys.argv[3]}", 2, int(sys.argv[4]))
from rloo_jax.mesh import make_mesh, process_slice
from rloo_jax.rewards import RewardFunction, compute_rewards, load_reward_model_scorer, place_reward_models

# 8 rows of different lengths: the first 4 short, the last 4 long, so each process of two pads to another width
PROMPTS = ["ab", "c", "abc", "a", "abcabcabcabc", "bcabcabcabcab", "cabcabcabcabcab", "aabbccaabbccaabbcc"]
COMPLETIONS = ["c", "de", "f", "", "defdefdefdef", "efefefefef", "fdfdfdfd", "ddeeffddeeff"]

def scores(mesh, rows=slice(0, 8)):
    scorer = load_reward_model_scorer(folder, bucket=8)
    funcs = [RewardFunction("rm", scorer)]
    place_reward_models(funcs, mesh)
    n = rows.stop - rows.start
    return compute_rewards(funcs, PROMPTS[rows], COMPLETIONS[rows], [[1]] * n, {})[:, 0], scorer.score_fn

out = {}
if mode == "compare":
    out["single"] = scores(None)[0].tolist()
    for shape in [(2, 2, 2), (1, 8, 1), (1, 2, 4)]:
        got, call = scores(make_mesh(*shape))
        out[str(shape)] = got.tolist()
        leaves = {jax.tree_util.keystr(k): w for k, w in jax.tree_util.tree_leaves_with_path(call._placed)}
        for name, w in [("embed", next(w for k, w in leaves.items() if "embedding" in k)),
                        ("gate", next(w for k, w in leaves.items() if "gate" in k and "kernel" in k))]:
            out[f"{shape} {name}"] = [list(w.sharding.shard_shape(w.shape)), str(w.sharding.spec)]
else:
    rows = process_slice(8)
    got, _ = scores(make_mesh(2, 2, 2), rows)
    out = {"rows": [rows.start, rows.stop], "scores": got.tolist(), "devices": jax.device_count()}
print("RESULT " + json.dumps(out))
'''


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=forced_devices(devices))
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _result(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """The 8-device comparison and the two 4-device processes, run together (they are independent)."""
    from tests.test_mesh import _free_port

    folder = tmp_path_factory.mktemp("rm") / "rm"
    cfg = dict(demo.MODEL_CONFIG, architectures=["Qwen2ForSequenceClassification"])
    save_pretrained(init_reward_model(cfg, seed=3), folder, tokenizer=demo.build_tokenizer())
    port = str(_free_port())
    commands = {"compare": (["compare"], 8), "p0": (["process", port, "0"], 4), "p1": (["process", port, "1"], 4)}
    procs = {
        name: subprocess.Popen([sys.executable, "-c", WORKER, str(folder), *args], cwd=ROOT, env=_env(devices),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (args, devices) in commands.items()
    }
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"{name}: {stderr[-5000:]}"
            out[name] = _result(stdout)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


# float32 scores of magnitude up to ~3.6 from a sharded forward (another reduction order): measured <= 2.2e-6 apart
TOLERANCE = 1e-5


def test_sharded_reward_model_gives_the_unsharded_scores(results):
    single = np.asarray(results["compare"]["single"])
    assert np.ptp(single) > 0.1 and np.isfinite(single).all()  # eight different scores, not one repeated
    for shape in ["(2, 2, 2)", "(1, 8, 1)", "(1, 2, 4)"]:
        np.testing.assert_allclose(results["compare"][shape], single, atol=TOLERANCE, rtol=0, err_msg=shape)


def test_reward_model_weights_are_split_by_the_rule_table(results):
    """The embedding [vocab 49, embed 64]: embed over fsdp, vocab over tensor where it divides (49 only by 1); an
    MLP kernel [layers 2, embed 64, mlp 128]: embed over fsdp, mlp over tensor (Megatron), as the policy's."""
    compare = results["compare"]
    assert compare["(2, 2, 2) embed"] == [[49, 32], "P(None, 'fsdp')"]
    assert compare["(1, 8, 1) embed"] == [[49, 8], "P('tensor', 'fsdp')"]
    assert compare["(1, 2, 4) embed"] == [[49, 32], "P(None, 'fsdp')"]
    assert compare["(2, 2, 2) gate"] == [[2, 32, 64], "P(None, 'fsdp', 'tensor')"]  # [layers 2, 64, 128] stacked
    assert compare["(1, 8, 1) gate"] == [[2, 8, 128], "P(None, 'fsdp', 'tensor')"]
    assert compare["(1, 2, 4) gate"] == [[2, 32, 32], "P(None, 'fsdp', 'tensor')"]


def test_two_processes_score_their_own_rows_as_one(results):
    """Each process scores its 4 rows (padded to another width than the other's) on one 8-device mesh."""
    p0, p1 = results["p0"], results["p1"]
    assert (p0["rows"], p1["rows"], p0["devices"]) == ([0, 4], [4, 8], 8)
    np.testing.assert_allclose(p0["scores"] + p1["scores"], results["compare"]["single"], atol=TOLERANCE, rtol=0)


# ------------------------------------------------------------------------------------------------ compile-only
REWARD_LLAMA = dict(architectures=["LlamaForSequenceClassification"], model_type="llama", vocab_size=256,
                    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, num_labels=1)


def test_compiled_reward_model_memory_per_chip_falls_with_the_slice(tmp_path):
    """The trainer's reward-model call compiled for a v5e-8 (fsdp over its 8 chips, a global batch of 64 x 128
    tokens): the compiler's per-chip argument bytes are an eighth of the weights and the batch (one chip, the old
    unsharded scorer, held all of them)."""
    from rloo_jax.mesh import make_mesh, per_chip_bytes
    from rloo_jax.models import abstract_model
    from rloo_jax.programs import reward_model_program
    from rloo_jax.tpu import parse_slice, topology_devices

    (tmp_path / "config.json").write_text(json.dumps(REWARD_LLAMA))
    model = abstract_model(tmp_path, "reward", "bfloat16")
    mesh = make_mesh(1, -1, 1, devices=topology_devices(parse_slice("v5e-8")))
    program = reward_model_program("reward_model_0", model, mesh, (64, 128))
    lower, weights = program.lower, per_chip_bytes(program.args[0])
    arguments = lower().compile().memory_analysis().argument_size_in_bytes
    total = 2 * (256 * 256 + 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 256 + 256)
    batch = 2 * 64 * 128 * 4  # ids and mask, int32
    assert weights == total // 8  # bf16 weights (embedding, 2 blocks, final norm, score head), each split by fsdp
    # the compiler's count: the same bytes plus TPU tile padding of the small per-chip vectors (measured 1664 bytes;
    # 512 for the whole model compiled for one chip)
    assert 0 <= arguments - (total + batch) // 8 <= 2048


def test_compile_only_report_counts_the_sharded_reward_model(tmp_path, tiny_checkpoint, capsys):
    """`--compile_only` with a reward model: its program is compiled sharded over the slice, and its weights are
    resident beside the train state in every program's figure."""
    from tests.test_compile_only import TINY_LLAMA, common, config_only_model, run_main

    policy = config_only_model(tmp_path / "p", TINY_LLAMA, tiny_checkpoint("tokenizer"))
    rm_config = dict(TINY_LLAMA, architectures=["LlamaForSequenceClassification"], num_labels=1)
    rm = config_only_model(tmp_path / "rm", rm_config, tiny_checkpoint("tokenizer"))
    code, out, err = run_main(capsys, common(tmp_path, policy) + ["--topology", "v5e-4",
                                                                 "--reward_model_name_or_path", str(rm)])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    programs, s = report["programs"], report["settings"]
    assert set(programs) == {"rollout", "update", "score", "reward_model_0"} and "est. step" in out
    # bf16 weights (bf16 is on for a TPU) of the reward model (TINY_LLAMA without its LM head, plus the score head
    # [64, 1]), / 4 chips
    d, f, v, layers = 64, 128, 160, 2
    weights = 2 * (v * d + layers * (2 * d * d + 2 * d * 32 + 3 * d * f + 2 * d) + d + d) // 4
    assert s["reward_model_bytes_per_chip"] == [weights]
    rm = programs["reward_model_0"]
    assert rm["fits"] and rm["flops"] > 0 and rm["argument_bytes"] < 4 * weights  # the compiler got a shard
    # resident everywhere: the state and the reward model (the rollout and update add their batch arrays)
    n = s["completions_per_generation"]
    batch = 4 * (2 * s["prompts_per_generation"] * 16 + 4 * n * 32) // 4
    assert programs["rollout"]["resident_bytes"] == programs["update"]["resident_bytes"] == rm["resident_bytes"] + batch
