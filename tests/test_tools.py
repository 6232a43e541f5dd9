"""Tool calling on the host (rloo_jax.tools): the runner's safety (a hanging, a raising, an unknown tool, bad
arguments, a call limit: each a failure reported to the model, nothing raises), the parsing of the model's turns
(malformed tool-call text), the tool-result tokens (TRL's `_get_tool_suffix_ids`), environments, the loss mask and
the configuration errors."""

import asyncio
import time

import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import demo_tools
from rloo_jax.errors import ConfigError
from rloo_jax.step import loss_mask
from rloo_jax.tools import Call, EnvironmentPool, ToolRunner, as_tool, parse_turn, resolve_object, tool_suffix_ids


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def slow_async(seconds: float) -> str:
    """Sleep without blocking.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


async def fails_async(x: int) -> int:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no {x}")


def tools(*fns):
    made = [as_tool(f) for f in fns]
    return {t.name: t for t in made}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_runner_reports_every_failure_and_never_raises():
    """Sync and async, ok, raising, hanging (the timeout), an unknown name, bad arguments, a non-function call and
    a rollout over its limit: every call has a Result in order, failures as TRL's `{'error': ...}` text."""
    box = tools(demo_tools.multiply, demo_tools.divide, slow, slow_async, fails_async)
    runner = ToolRunner(timeout=0.3, max_workers=4)
    calls = [
        Call(0, call("multiply", a=6, b=7), box),
        Call(0, call("divide", a=1, b=0), box),
        Call(1, call("slow", seconds=30.0), box),
        Call(1, call("slow_async", seconds=30.0), box),
        Call(2, call("power", a=2, b=3), box),
        Call(2, call("multiply", x=3), box),
        Call(3, {"type": "code", "name": "multiply"}, box),
        Call(3, call("multiply", a=1, b=2), box, allowed=False),
        Call(4, call("fails_async", x=5), box),
        Call(4, call("slow_async", seconds=0.01), box),
        Call(5, {"type": "function", "function": {"name": "multiply", "arguments": "a=1"}}, box),
    ]
    t0 = time.perf_counter()
    results = runner.run(calls)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0  # the hanging calls waited for once, together (0.3 s), not 30 s each
    got = [(r.name, r.content, r.failed, r.error) for r in results]
    assert got == [
        ("multiply", "42", False, None),
        ("divide", "{'error': 'division by zero'}", True, "raised"),
        ("slow", "{'error': 'Tool slow timed out after 0.3 s'}", True, "timeout"),
        ("slow_async", "{'error': 'Tool slow_async timed out after 0.3 s'}", True, "timeout"),
        ("power", "{'error': 'Tool power not found.'}", True, "unknown"),
        ("multiply", "{'error': \"multiply() got an unexpected keyword argument 'x'\"}", True, "raised"),
        ("multiply", "{'error': 'Unsupported tool call type: code'}", True, "type"),
        ("multiply", "{'error': 'Tool call limit of this rollout reached.'}", True, "limit"),
        ("fails_async", "{'error': 'no 5'}", True, "raised"),
        ("slow_async", "woke", False, None),
        ("multiply", "{'error': 'multiply() argument after ** must be a mapping, not str'}", True, "raised"),
    ]
    # the runner is usable again at once: the timed-out thread gave its worker slot back
    assert [r.content for r in runner.run([Call(0, call("multiply", a=2, b=3), box)] * 4)] == ["6"] * 4
    runner.close()


def test_runner_runs_a_batch_concurrently():
    """8 sync and 8 async calls of 0.2 s each finish in about one call's time (threads and one event loop)."""
    box = tools(slow, slow_async)
    runner = ToolRunner(timeout=5.0, max_workers=8)
    t0 = time.perf_counter()
    results = runner.run([Call(i, call("slow", seconds=0.2), box) for i in range(8)]
                         + [Call(i, call("slow_async", seconds=0.2), box) for i in range(8)])
    assert time.perf_counter() - t0 < 1.2 and all(r.content == "woke" for r in results)
    runner.close()


@pytest.fixture(scope="module")
def tokenizer():
    """The demo's tokenizer shape (Qwen3 training template and response template) on a small BPE."""
    convs = demo_tools.sft_conversations(40, seed=0)
    probe = demo_tools.build_tokenizer([""], vocab_size=300)
    texts = [probe.apply_chat_template(c, tools=demo_tools.TOOLS, tokenize=False) for c in convs]
    return demo_tools.build_tokenizer(texts, vocab_size=300)


def test_parse_turn_reads_calls_and_flags_malformed_text(tokenizer):
    good = ('<think>\n\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
            '<|im_end|>')
    message, malformed = parse_turn(tokenizer, tokenizer.encode(good), [], demo_tools.TOOLS)
    assert not malformed
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "multiply",
                                                                       "arguments": {"a": 3, "b": 4}}}]
    bad = '<think>\n\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3,\n</tool_call><|im_end|>'
    message, malformed = parse_turn(tokenizer, tokenizer.encode(bad), [], demo_tools.TOOLS)
    assert malformed and "tool_calls" not in message and message["role"] == "assistant"
    assert '"name": "multiply"' in message["content"]  # the decoded text, as TRL keeps it
    plain = "<think>\n\n</think>\n\nThe answer is 12.<|im_end|>"
    message, malformed = parse_turn(tokenizer, tokenizer.encode(plain), [], demo_tools.TOOLS)
    assert not malformed and message["content"] == "The answer is 12." and not message.get("tool_calls")


def test_tool_suffix_ids_are_trls(tokenizer):
    """The ids the tool messages add after an assistant turn (its EOS included in the turn): the tool block and the
    next assistant header, as TRL's `_get_tool_suffix_ids` computes them for a Qwen3 template."""
    messages = [{"role": "tool", "name": "multiply", "content": "12"}, {"role": "tool", "name": "add", "content": "7"}]
    ids = tool_suffix_ids(tokenizer, messages)
    assert tokenizer.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n7\n"
                                     "</tool_response><|im_end|>\n<|im_start|>assistant\n")


class Counter:
    def __init__(self):
        self.count = 0
        self.target = 0

    def reset(self, target: int = 0, **kwargs):
        self.count, self.target = 0, target
        return f" (target {target})"

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much.
        """
        self.count += step
        return str(self.count)

    def get_reward(self):
        return float(self.count == self.target)


def test_environment_pool_reuses_instances_and_gives_tools_and_a_reward():
    pool = EnvironmentPool(Counter, [as_tool(demo_tools.add)])
    assert [t.name for t in pool.tools[None]] == ["add", "increment"]
    first = pool.assign([None, None])
    again = pool.assign([None, None, None])
    assert again[:2] == first and len(pool.pool[None]) == 3  # built once, grown only when a batch needs more
    first[0].reset(target=2)
    first[0].increment(2)
    (name, reward), = pool.reward_functions()
    assert name == "Counter" and reward(environments=first) == [1.0, 1.0]
    with pytest.raises(ConfigError, match="environment='b'"):
        EnvironmentPool({"a": Counter}).assign(["b"])


def undocumented(x):
    return x


def test_configuration_errors_name_the_fix():
    with pytest.raises(ConfigError, match="tool undocumented: no JSON schema .* give every argument a type hint"):
        as_tool(undocumented)
    with pytest.raises(ConfigError, match="tool 'rloo_jax.demo_tools:nothing': rloo_jax.demo_tools has no attribute"):
        resolve_object("rloo_jax.demo_tools:nothing", "tool")
    with pytest.raises(ConfigError, match="name it as module:attribute"):
        resolve_object("calculator", "tool")
    assert resolve_object("rloo_jax.demo_tools:multiply", "tool") is demo_tools.multiply


def test_loss_mask_keeps_the_models_tokens():
    mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    tool = jnp.array([[1, 0, 0, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(loss_mask(mask, tool), [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]])
    assert loss_mask(mask, None) is mask


def test_transcript_shows_calls_and_results():
    from rloo_jax.conversations import transcript

    messages = [
        {"role": "user", "content": "What is 7 * 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 7, "b": 3}}}]},
        {"role": "tool", "name": "multiply", "content": "21"},
        {"role": "assistant", "content": "Both:", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 1'}}]},  # unparsed text
        {"role": "tool", "content": "{'error': 'bad'}"},
        {"role": "assistant", "content": "The answer is 21."},
    ]
    assert transcript(messages) == (
        "user: What is 7 * 3? | assistant: -> multiply(a=7, b=3) | tool multiply: 21 | "
        "assistant: Both: -> add({\"a\": 1) | tool: {'error': 'bad'} | assistant: The answer is 21.")
    assert transcript("plain text") == "plain text"
