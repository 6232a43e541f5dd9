"""A training run survives every kind of tool failure (issue 38): a hanging tool (cut at tool_timeout), a raising one,
an unknown tool name and malformed tool-call text (a turn cut mid-call by max_completion_length) each leave the run
going, reported to the model as TRL reports errors and counted in the metrics and rollouts.jsonl."""

import time

import pytest

import rloo_jax
from rloo_jax import demo_tools
from rloo_jax.metrics import read_jsonl

pytestmark = pytest.mark.slow  # one short run of the demo policy (~50 s, built once per machine)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    time.sleep(60)  # hangs: cut at tool_timeout
    return a + b


def test_a_run_survives_hanging_raising_unknown_and_malformed_calls(tmp_path, tools_policy):
    prompts = ["add 3 4", "power 2 5", "divide 7 by 0", "add and multiply 3 4"]
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in prompts]
    args = rloo_jax.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=2,
                               max_completion_length=24, top_k=1, max_steps=1, logging_steps=1, seed=0,
                               compilation_cache=False, tool_timeout=0.5, log_completions=True, beta=0.0)
    trainer = rloo_jax.GRPOTrainer(tools_policy, lambda completions, **kw: [1.0] * len(completions),
                                   args=args, train_dataset=rows, tools=[demo_tools.multiply, add, demo_tools.divide])
    assert trainer.train().global_step == 1
    record = read_jsonl(tmp_path / "metrics.jsonl")[0]
    # 6 calls in 8 completions (add: timed out, power: unknown, divide by 0: raised; 2 rollouts each), all failed;
    # the two `add and multiply` turns (28 tokens) are cut inside their second call at 24 tokens: malformed text,
    # no call. The single-call turns (16-17 tokens) leave no room for their results: rolled back, as TRL does
    assert record["tools/call_frequency"] == 0.75 and record["tools/failure_frequency"] == 1.0
    assert record["tools/malformed_frequency"] == 0.25
    # the hanging calls (60 s each) were waited for once, together, for tool_timeout (0.5 s); a wall-time bound far
    # from both, as the time of one tool wave is not what this test measures
    assert record["timing/tools"] < 20.0
    calls = [c for r in read_jsonl(tmp_path / "rollouts.jsonl") for c in r["tool_calls"]]
    assert sorted({(c["name"], c["error"]) for c in calls}) == [("add", "timeout"), ("divide", "raised"),
                                                                 ("power", "unknown")]
    assert {c["result"] for c in calls} == {"{'error': 'Tool add timed out after 0.5 s'}",
                                            "{'error': 'division by zero'}", "{'error': 'Tool power not found.'}"}
    assert all(c["dropped"] for c in calls)
