"""GRPO after `kill -9`: a tool-calling run (multi-turn rollouts: the tool-calling demo policy calls `multiply`, its
results appended to the row's KV cache) with the adaptive entropy controller on, training QLoRA adapters (LoRA on a
4-bit nf4 base), killed once its first checkpoint is complete and a later step is logged, resumes bit-identically to
an uninterrupted run: the same tool calls, results, tool masks, metrics and adapters. The controller's state (the
coefficient and the last step's entropy, TRL's entropy_ctrl_state.json) is in every checkpoint; the 4-bit base is not
(it is quantized again from the model folder), the adapters and their AdamW moments are. The tools are deterministic,
so a resumed generation batch makes the calls the straight run made. tests/test_reliability.py's machinery (a
`python -m rloo_jax.train` subprocess per launch)."""

import re

import numpy as np
import orbax.checkpoint as ocp
import pytest

from rloo_jax import demo, demo_tools
from rloo_jax.conversations import transcript
from rloo_jax.metrics import read_jsonl
from tests.fixtures_models import tools_policy  # noqa: F401
from tests.test_reliability import (
    Launch,
    cache,
    checkpoint_names,
    kill_when,
    sha256,
    step_after_checkpoint,
)

__all__ = ["cache"]  # the module's shared compilation cache (a fixture)

DELTA = 0.01
TOOLS = ",".join(f"rloo_jax.demo_tools:{t.__name__}" for t in demo_tools.TOOLS)
# 6 optimizer steps, 2 per generation batch (off-policy: the old log-probs recomputed), checkpoints at 2, 4, 6 (the
# last two kept); up to 2 tool rounds per rollout; the KL term (its reference: the 4-bit base, adapters off); the
# controller's target above any entropy the policy's 1000-token vocabulary allows (ln 1000 = 6.9), so its
# coefficient rises by DELTA after every step and the bonus applies from step 2 (after step 1's measurement): a
# resume that lost either half of the state logs another coefficient or applies no bonus at its first step
GRPO_QLORA_TOOLS_RUN = [
    "grpo", "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "2", "--logging_steps", "1",
    "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "2",
    "--max_completion_length", "48", "--max_prompt_length", "160", "--eval_steps", "None", "--learning_rate", "1e-3",
    "--log_completions", "true", "--beta", "0.04", "--loss_type", "dapo", "--entropy_coef", "0.01",
    "--use_adaptive_entropy", "true", "--entropy_coef_delta", str(DELTA), "--entropy_target", "10",
    "--use_peft", "--lora_target_modules", "all-linear", "--lora_r", "4", "--load_in_4bit",
    "--full_determinism", "true", "--tools", TOOLS, "--max_tool_calling_iterations", "2",
    "--reward_funcs", "rloo_jax.demo_tools:answer_reward",
]  # fmt: skip
WALL_TIME = {"step_time", "timing/sample", "timing/reference", "timing/reward", "timing/update", "timing/tools"}


def without_wall_time(records):
    """Metrics or rollout records without their wall times (a tool call's `seconds` among them)."""
    out = []
    for r in records:
        r = {k: v for k, v in r.items() if k not in WALL_TIME}
        if "tool_calls" in r:
            r["tool_calls"] = [{k: v for k, v in c.items() if k != "seconds"} for c in r["tool_calls"]]
        out.append(r)
    return out


@pytest.fixture
def run(tools_policy, tmp_path):  # noqa: F811
    """The run's command line: the tool-calling policy on `What is a * b?` prompts (a folder of jsonl)."""
    data = demo.prepare_dataset(tmp_path / "data", 7, 64, 8, rows=demo_tools.task_rows)
    return [*GRPO_QLORA_TOOLS_RUN, "--model_name_or_path", tools_policy, "--dataset_name", data]


def test_killed_grpo_qlora_tool_calling_run_with_adaptive_entropy_resumes_bit_identical(cache, run, tmp_path):  # noqa: F811
    straight = Launch(tmp_path / "straight", cache, tmp_path / "straight", run)
    assert straight.wait() == 0, straight.output()[1][-3000:]
    out = tmp_path / "run"
    kill_when(out, cache, tmp_path / "killed", run, step_after_checkpoint(out, 3, 2))
    last = Launch(out, cache, tmp_path / "last", run)
    assert last.wait() == 0, last.output()[1][-3000:]
    # from checkpoint 2 (or 4, had its asynchronous save completed before the kill landed): a controller moved on
    assert re.findall(r"Resuming from checkpoint .*/(\d+) ", last.output()[0]) in (["2"], ["4"])

    adapters = "final/adapter_model.safetensors"
    assert sha256(out / adapters) == sha256(tmp_path / "straight" / adapters)
    got = read_jsonl(out / "metrics.jsonl")
    assert without_wall_time(got) == without_wall_time(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    rollouts = without_wall_time(read_jsonl(out / "rollouts.jsonl"))
    assert rollouts == without_wall_time(read_jsonl(tmp_path / "straight" / "rollouts.jsonl"))
    # the rollouts are conversations: calls made, their results read back (tool tokens out of the loss)
    calls = [c for r in rollouts for c in r["tool_calls"]]
    assert calls and all(c["name"] == "multiply" and not c["failed"] for c in calls), calls
    assert any(0 in r["tool_mask"] and r["turns"] == 2 for r in rollouts)
    # as the rollout notebook shows them: the call, its result, the answer
    shown = next(transcript(r["completion"]) for r in rollouts if r["turns"] == 2)
    assert shown.startswith("assistant: -> multiply(a=") and " | tool multiply: " in shown, shown
    assert next(r for r in got if "tools/call_frequency" in r)["tools/call_frequency"] > 0
    train = [r for r in got if "entropy_coef" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    # the controller moved at every step: 0.01 + DELTA per step
    np.testing.assert_allclose([r["entropy_coef"] for r in train], [0.01 + DELTA * s for s in range(1, 7)],
                               rtol=1e-6)
    # each checkpoint holds the controller as it stood after its step (the last step's entropy: its window's); the
    # demo's save_total_limit 2 keeps the last two
    assert sorted(map(int, checkpoint_names(out))) == [4, 6]
    for step in (4, 6):
        state = ocp.StandardCheckpointer().restore(out / "checkpoints" / str(step) / "state")["train"]
        record = next(r for r in train if r["step"] == step)
        assert float(state["algo_state"]["entropy_coef"]) == np.float32(record["entropy_coef"])
        assert float(state["algo_state"]["last_entropy"]) == np.float32(record["entropy"])
        # QLoRA: the adapters and their moments, not the frozen 4-bit base
        assert state["frozen"] is None or not state["frozen"], step
        assert "lora_b" in str(state["params"])
