"""Rewards: resolution of specs, None/NaN handling, errors naming the function, async, built-in goldens."""

import asyncio
import logging
import math

import numpy as np
import pytest

from rloo_jax import demo
from rloo_jax.errors import ConfigError, RewardError
from rloo_jax.rewards import (
    RewardFunction,
    RewardLogs,
    RewardModelScorer,
    TrainerState,
    accuracy_reward,
    builtin_rewards,
    compute_rewards,
    extract_answer,
    format_reward_error,
    import_function,
    make_format_reward,
    make_soft_overlong_reward,
    normalize_answer,
    repeat_per_generation,
    resolve_reward_funcs,
    reward_model_texts,
    right_pad,
    warn_missing_extras,
)

BUILTINS = builtin_rewards(r"^<think>(?!.*<think>)(.*?)</think>.*$", 10, 4)


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def nones(completions, **kwargs):
    return [None, float("nan"), float("inf"), 1.0][: len(completions)]


def fails_on_b(completions, **kwargs):
    return [{"a": 1.0}[c] for c in completions]


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [2.0] * len(completions)


def call(funcs, completions, **columns):
    n = len(completions)
    return compute_rewards(funcs, ["p"] * n, completions, [[1]] * n, columns)


def test_resolve_specs_in_order(tmp_path):
    script = tmp_path / "my_rewards.py"
    script.write_text("def shout(completions, **kw):\n    return [1.0] * len(completions)\n")
    loaded = []
    funcs = resolve_reward_funcs(
        [
            "accuracy",
            "tests.test_rewards:length_reward",
            f"{script}:shout",
            "org/rm",
            "tests.test_rewards:length_reward",
        ],
        BUILTINS,
        load_reward_model=lambda path: loaded.append(path) or length_reward,
    )
    assert [f.name for f in funcs] == ["accuracy", "length_reward", "shout", "rm", "length_reward_2"]
    assert loaded == ["org/rm"] and funcs[0].fn is accuracy_reward


def test_resolve_errors_name_the_entry():
    with pytest.raises(ConfigError, match="reward function 'nosuchmodule_xyz:f': cannot import 'nosuchmodule_xyz'"):
        resolve_reward_funcs(["nosuchmodule_xyz:f"], BUILTINS)
    with pytest.raises(ConfigError, match="module 'tests.test_rewards' has no callable 'missing'"):
        import_function("tests.test_rewards:missing")
    with pytest.raises(ConfigError, match="'acurracy' is not a built-in .accuracy, accuracy_reward, format, "):
        resolve_reward_funcs(["acurracy"], BUILTINS)
    with pytest.raises(ConfigError, match="no such file"):
        import_function("/nonexistent/r.py:f")


def test_trl_names_dotted_paths_and_callables_resolve():
    funcs = resolve_reward_funcs(
        ["accuracy_reward", "think_format_reward", "tests.test_rewards.length_reward", length_reward], BUILTINS
    )
    assert [f.name for f in funcs] == ["accuracy_reward", "think_format_reward", "length_reward", "length_reward_2"]
    assert funcs[0].fn is accuracy_reward and funcs[1].fn is BUILTINS["format"] and funcs[3].fn is length_reward


def test_trls_context_arguments_and_what_rewards_log():
    """trainer_state, log_extra and log_metric reach every function; a failure still names the sample (the context
    is not sliced per sample)."""
    logs, state = RewardLogs(), TrainerState(global_step=3, max_steps=10)

    def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):
        log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
        log_extra("n", [len(c) for c in completions])
        return [float(len(c)) * trainer_state.global_step for c in completions]

    out = compute_rewards([RewardFunction("shaped", shaped)], ["p", "p"], ["ab", "c"], [[1], [2]], {},
                          logs.context(state))
    np.testing.assert_array_equal(out[:, 0], [6.0, 3.0])
    assert logs.take() == ({"n": [2, 1]}, {"progress": (0.3, 1)}) and logs.take() == ({}, {})
    with pytest.raises(RewardError, match="on sample 1"):
        compute_rewards([RewardFunction("fails", fails_on_b)], ["p", "p"], ["a", "b"], [[1], [2]], {},
                        logs.context(state))


def test_accuracy_without_math_verify_warns_once_naming_the_extra(monkeypatch, caplog):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        warn_missing_extras(resolve_reward_funcs(["accuracy", "format"], BUILTINS))
        warn_missing_extras(resolve_reward_funcs(["format", "soft_overlong"], BUILTINS))
    assert caplog.text.count("math-verify is not installed") == 1 and "pip install 'rloo_jax[math]'" in caplog.text


def test_values_kwargs_and_columns():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completion_ids=completion_ids, answer=answer, extra=kwargs)
        return [0.5] * len(completions)

    out = compute_rewards(
        [RewardFunction("spy", spy), RewardFunction("len", length_reward)],
        ["p", "p"],
        ["ab", "abc"],
        [[3, 4], [5, 6, 1]],
        {"answer": ["x", "x"], "id": [1, 1]},
    )
    assert out.dtype == np.float32 and out.shape == (2, 2)
    np.testing.assert_array_equal(out, [[0.5, 2.0], [0.5, 3.0]])
    assert seen == {
        "prompts": ["p", "p"],
        "completion_ids": [[3, 4], [5, 6, 1]],
        "answer": ["x", "x"],
        "extra": {"id": [1, 1]},
    }
    assert repeat_per_generation(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]


def test_none_nan_inf_become_nan_with_one_warning(caplog):
    func = RewardFunction("nones", nones)
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        out = call([func], ["a", "b", "c", "d"])
        call([func], ["a", "b", "c", "d"])
    assert np.isnan(out[:3, 0]).all() and out[3, 0] == 1.0
    assert caplog.text.count("'nones' returned None/NaN/inf for 3 of 4") == 1


def test_wrong_length_and_wrong_type_name_the_function():
    with pytest.raises(RewardError, match="'short' returned 1 rewards, but 2 were expected"):
        call([RewardFunction("short", lambda completions, **k: [1.0])], ["a", "b"])
    with pytest.raises(RewardError, match="'texty' returned 'x' for sample 0"):
        call([RewardFunction("texty", lambda completions, **k: ["x", 1])], ["a", "b"])
    with pytest.raises(RewardError, match="'scalar' returned float"):
        call([RewardFunction("scalar", lambda completions, **k: 1.0)], ["a", "b"])


def test_exception_names_function_and_first_failing_sample():
    with pytest.raises(RewardError) as info:
        call([RewardFunction("fails_on_b", fails_on_b)], ["a", "a", "b", "a"])
    msg = str(info.value)
    assert "reward function 'fails_on_b' raised KeyError: 'b' on sample 2" in msg and "completion 'b'" in msg
    text = format_reward_error(info.value)
    assert "Traceback" in text and "in fails_on_b" in text and text.endswith(msg)


def test_async_functions_run_and_fail_clearly():
    out = call([RewardFunction("a", async_reward), RewardFunction("len", length_reward)], ["ab"])
    np.testing.assert_array_equal(out, [[2.0, 2.0]])

    async def broken(completions, **kwargs):
        raise RuntimeError("boom")

    with pytest.raises(RewardError, match="'broken' raised RuntimeError: boom"):
        call([RewardFunction("broken", broken)], ["ab"])

    class Scorer:
        async def __call__(self, completions, **kwargs):
            return [3.0] * len(completions)

    assert RewardFunction("s", Scorer()).is_async and not RewardFunction("l", length_reward).is_async
    np.testing.assert_array_equal(call([RewardFunction("s", Scorer())], ["x"]), [[3.0]])


def test_extract_and_normalize_answer_goldens():
    assert extract_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer("Natalia sold 48/2 = 24 clips.\n#### 1,234") == "1,234"
    assert extract_answer("it is 7 or 8.") == "8" and extract_answer("no digits") is None
    assert extract_answer(r"\boxed{a} then \boxed{b{c}}") == "b{c}"
    assert normalize_answer("1,000.50") == "1000.5" == normalize_answer("$1000.5")
    assert normalize_answer(" 42. ") == "42.0" and normalize_answer(r"\text{Yes}") == "yes"


def test_accuracy_reward_goldens(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # the fallback normalizer, math-verify or not
    completions = ["The answer is 72", [{"role": "assistant", "content": r"\boxed{72.0}"}], "maybe 71", "none"]
    gold = ["#### 72", "#### 72", "#### 72", "no number here"]
    assert accuracy_reward(completions, answer=gold) == [1.0, 1.0, 0.0, None]
    assert accuracy_reward(["x = 3"], solution=[r"\boxed{3}"]) == [1.0]
    with pytest.raises(ValueError, match="needs an `answer` or `solution` column"):
        accuracy_reward(["3"])


def test_format_and_soft_overlong_goldens():
    fmt = make_format_reward(r"^<think>(?!.*<think>)(.*?)</think>.*$")
    assert fmt(["<think>\nr\n</think>\nA", "<think>r", [{"content": "<think>a</think>b"}]]) == [1.0, 0.0, 1.0]
    soft = make_soft_overlong_reward(10, 4)
    assert soft([[1] * 6, [1] * 8, [1] * 10, [1] * 11]) == [0.0, -0.5, -1.0, -1.0]
    assert BUILTINS["soft_overlong"](completion_ids=[[1] * 7]) == [pytest.approx(-0.25)]


def test_demo_reward_golden():
    assert demo.letters_reward(["aacx", "", [{"content": "ee"}]], letters=["ace", "ace", "ace"]) == [0.75, 0.0, 1.0]


def test_reward_model_scorer_text_padding_and_scores():
    tok = demo.build_tokenizer()
    calls = []

    def score(ids, mask):
        calls.append((ids, mask))
        return (ids * mask).sum(axis=1).astype(np.float32)

    scorer = RewardModelScorer(score, tok, bucket=4)
    out = scorer(prompts=["ab", "a"], completions=["c", "bcdef"])
    ids, mask = calls[0]
    assert ids.shape == (2, 8)  # right-padded to a multiple of the bucket
    np.testing.assert_array_equal(ids[0], [5, 6, 7, 0, 0, 0, 0, 0])  # "abc", no special tokens added
    np.testing.assert_array_equal(mask.sum(1), [3, 6])
    assert out == [18.0, 5 + 6 + 7 + 8 + 9 + 10]
    chat = [[{"role": "user", "content": "ab"}]]
    assert reward_model_texts(chat, [[{"role": "assistant", "content": "c"}]], tok) == ["<|user|>ab<|assistant|>c"]
    ids, mask = right_pad([[1, 2], []], 0, 2)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 0]]) and np.testing.assert_array_equal(mask, [[1, 1], [0, 0]])


def test_reward_model_through_compute_rewards_is_finite():
    tok = demo.build_tokenizer()
    scorer = RewardModelScorer(lambda ids, mask: mask.sum(1).astype(np.float32), tok, bucket=8)
    out = compute_rewards([RewardFunction("rm", scorer)], ["ab"] * 2, ["c", "cd"], [[1], [1, 2]], {})
    np.testing.assert_array_equal(out[:, 0], [3.0, 4.0])
    assert not any(math.isnan(v) for v in out[:, 0])


def test_load_reward_model_scorer_matches_a_direct_model_call(tmp_path):
    from rloo_jax.models import init_reward_model, save_pretrained
    from rloo_jax.rewards import load_reward_model_scorer

    cfg = dict(demo.MODEL_CONFIG, architectures=["Qwen2ForSequenceClassification"])
    model = init_reward_model(cfg, seed=3)
    save_pretrained(model, tmp_path / "rm", tokenizer=demo.build_tokenizer())
    funcs = resolve_reward_funcs([str(tmp_path / "rm")], BUILTINS, load_reward_model=load_reward_model_scorer)
    assert funcs[0].name == "rm"
    out = compute_rewards(funcs, ["ab", "abc"], ["c", "d"], [[1], [1]], {})
    tok = demo.build_tokenizer()
    for row, text in enumerate(["abc", "abcd"]):
        ids = np.asarray([tok(text)["input_ids"]], np.int32)
        expected = np.asarray(model(ids, np.ones_like(ids)))[0]
        np.testing.assert_allclose(out[row, 0], expected, rtol=1e-5, atol=1e-6)
