"""Reliability: SIGKILL at random points resumes bit-identically, SIGTERM saves and exits 0, non-finite updates
are skipped and stop the run, bad invocations exit 2 and touch nothing, unsafe inputs are refused."""

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rloo_jax import demo
from rloo_jax.checkpoint import Checkpointer, NonFiniteError, nonfinite_leaves
from rloo_jax.cli import load_config, main
from rloo_jax.logwindow import LogWindow, steps
from rloo_jax.metrics import drop_records_after, read_jsonl
from rloo_jax.models import load_causal_lm
from rloo_jax.numerics import model_options
from rloo_jax.optimizer import make_optimizer, skipped_updates
from rloo_jax.step import TrainState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALL_TIME = {"step_time", "timing/sample", "timing/reference", "timing/reward", "timing/update"}
# A short demo run exercising every piece of resumable state: a logging window spanning checkpoints (logging 3,
# saves 2), eval RNG, reference-model syncs, rollout records, cumulative token / truncation counters.
RUN = [
    "--max_steps", "12", "--save_steps", "2", "--logging_steps", "3", "--eval_steps", "5",
    "--per_device_train_batch_size", "16", "--num_generations", "4", "--per_device_eval_batch_size", "16",
    "--max_completion_length", "6", "--max_prompt_length", "5", "--log_completions", "true",
    "--sync_ref_model", "true", "--ref_model_sync_steps", "4", "--ref_model_mixup_alpha", "0.5",
    "--full_determinism", "true",  # bit-exact on GPU too (XLA's deterministic ops; CPU programs are anyway)
    # a dense reward (the default demo's echo_reward is 0 for nearly every completion of a random policy: no gradient)
    "--reward_funcs", "rloo_jax.demo:letters_reward",
]  # fmt: skip


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def without_wall_time(records):
    return [{k: v for k, v in r.items() if k not in WALL_TIME} for r in records]


def snapshot(directory):
    """{relative path: (sha256, mtime_ns)} of every file under `directory`."""
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, directory)] = (sha256(p), os.stat(p).st_mtime_ns)
    return out


class Launch:
    """`python -m rloo_jax.train RUN --output_dir out` in a subprocess; stdout/stderr to files (no pipe stalls)."""

    def __init__(self, out, cache, log, run=RUN, **env):
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1", **env)  # the suite's platform (conftest)
        args = [*run, "--output_dir", str(out), "--compilation_cache_dir", str(cache)]
        self.stdout, self.stderr = open(f"{log}.out", "w"), open(f"{log}.err", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rloo_jax.train", *args], cwd=ROOT, env=env, stdout=self.stdout, stderr=self.stderr
        )

    def wait(self, timeout=480):  # a 12-step CLI run took 232-241 s under a load of 7 (2 cores)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stdout.close()
        self.stderr.close()

    def output(self):
        return open(f"{self.log}.out").read(), open(f"{self.log}.err").read()


def wait_for(proc, condition, timeout=120):
    """Poll `condition()` every ~2 ms while `proc` runs; True when it held (False if the process ended first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise TimeoutError("kill condition never held")


def kill_when(out, cache, log, run, condition, sig=signal.SIGKILL, timeout=120):
    """Launch `run` into `out`, send `sig` once `condition()` holds (within `timeout` s), and return the launch
    (ended, its output readable); fails if the run ended before its kill point."""
    launch = Launch(out, cache, log, run)
    try:
        assert wait_for(launch.proc, condition, timeout), f"{log}: the run ended before its kill point"
        launch.proc.send_signal(sig)
        assert launch.wait() == (0 if sig == signal.SIGTERM else -sig)
    finally:
        launch.close()
    return launch


def checkpoint_names(out):
    try:
        return os.listdir(out / "checkpoints")
    except FileNotFoundError:
        return []


def saving(out, at_least):
    """A checkpoint of step >= at_least is being written (orbax's temporary folder exists)."""
    return lambda: any(
        n.endswith(".orbax-checkpoint-tmp") and int(n.split(".")[0]) >= at_least for n in checkpoint_names(out)
    )


def step_after_checkpoint(out, step, checkpoint):
    """`step` logged once `checkpoint` is complete (orbax saves asynchronously: the step can come first)."""
    return lambda: str(checkpoint) in checkpoint_names(out) and logged(out, step)()


def logged(out, at_least):
    def condition():
        try:
            return any(r.get("step", 0) >= at_least for r in read_jsonl(out / "metrics.jsonl"))
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    return condition


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """The uninterrupted run."""
    d = tmp_path_factory.mktemp("reference")
    launch = Launch(d / "run", cache, d / "log")
    assert launch.wait() == 0, launch.output()[1][-3000:]
    return d / "run"


def test_killed_runs_resume_bit_identical_to_an_uninterrupted_run(reference, cache, tmp_path):
    out = tmp_path / "run"
    rng = random.Random(1234)  # fixed delays: the kill points are the same on every test run
    # (what triggers it, signal, extra delay); the first kill lands before any checkpoint is complete
    kills = [
        (saving(out, 1), signal.SIGKILL, 0.0),  # mid-save of the very first checkpoint: start over
        (logged(out, 6), signal.SIGKILL, rng.uniform(0.0, 0.15)),  # somewhere after step 6 was logged
        (saving(out, 8), signal.SIGKILL, 0.0),  # mid-save of checkpoint 8 or later
        (logged(out, 9), signal.SIGTERM, rng.uniform(0.0, 0.1)),  # preemption: save at the step boundary, exit 0
    ]
    resumed_from, being_written = [], {}
    for i, (condition, sig, delay) in enumerate(kills):
        launch = Launch(out, cache, tmp_path / f"log{i}")
        try:
            assert wait_for(launch.proc, condition), f"run {i} ended before its kill point"
            partial = [n for n in checkpoint_names(out) if "tmp" in n]
            time.sleep(delay)
            assert launch.proc.poll() is None, f"run {i} ended before its kill point"
            launch.proc.send_signal(sig)
            rc = launch.wait()
        finally:
            launch.close()
        stdout, stderr = launch.output()
        resumed_from.append(re.findall(r"Resuming from checkpoint .*/(\d+) ", stdout))
        if sig == signal.SIGTERM:
            assert rc == 0, stderr[-3000:]
            m = re.search(r"Stopped by SIGTERM at step (\d+)/12 \(checkpoint (.*)\)", stdout)
            assert m, stdout[-2000:]
            stopped = int(m.group(1))
            assert os.path.basename(m.group(2)) == str(stopped) and os.path.isdir(m.group(2))
            assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) <= stopped
        else:
            assert rc == -signal.SIGKILL
            if delay == 0.0:
                assert partial, f"run {i} was not killed mid-save"
                being_written[i] = min(int(n.split(".")[0]) for n in partial)
    last = Launch(out, cache, tmp_path / "last")
    assert last.wait() == 0, last.output()[1][-3000:]
    stdout, _ = last.output()
    resumed_from.append(re.findall(r"Resuming from checkpoint .*/(\d+) ", stdout))

    # the first run was killed while writing its first checkpoint: the next one started over
    assert resumed_from[0] == [] and resumed_from[1] == []
    # each later run resumed from a complete checkpoint, never from a half-written one; the SIGTERM run
    # left its checkpoint at the exact step it stopped at
    assert [len(r) for r in resumed_from[2:]] == [1, 1, 1]
    assert int(resumed_from[2][0]) >= 2 and int(resumed_from[3][0]) < being_written[2]
    assert int(resumed_from[4][0]) == stopped >= 9
    assert not [n for n in checkpoint_names(out) if "tmp" in n]

    assert sha256(out / "final" / "model.safetensors") == sha256(reference / "final" / "model.safetensors")
    got, want = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == [3, 5, 6, 9, 10, 12, 12]  # train at 3,6,9,12; eval at 5,10,12
    assert without_wall_time(got) == without_wall_time(want)
    assert read_jsonl(out / "rollouts.jsonl") == read_jsonl(reference / "rollouts.jsonl")
    assert len(read_jsonl(out / "rollouts.jsonl")) == 4 * 16  # every completion of the 4 logged steps
    train_rows = [r for r in got if "reward" in r]
    assert [r["num_tokens"] for r in train_rows] == sorted({r["num_tokens"] for r in train_rows})  # cumulative
    assert all(r["skipped_steps"] == 0 for r in train_rows)


# ------------------------------------------------------------------------------------------------ line separators
# every character str.splitlines splits on (tests/test_outputs.py checks the list is complete), and \r\n
SEPARATORS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
SEPARATOR_CHARS = "".join(s for s in SEPARATORS if len(s) == 1)


def separators_reward(completions, log_extra, log_metric, trainer_state, **kwargs):
    """The fraction of `a` in each completion; logs an extra column and a metric whose names and text hold every
    separator (completions hold them too: they are tokens of the policy's vocabulary). Steps 3 and 4 take 0.5 s
    more, so a kill lands between step 3's records and the end of the run."""
    if trainer_state.global_step >= 2:
        time.sleep(0.5)
    log_extra("extra\u2028column\r\n", [f"{c}|{'|'.join(SEPARATORS)}" for c in completions])
    log_metric("metric\u2029\x85name", 0.5)
    return [c.count("a") / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def separators_run(tmp_path_factory):
    """A tiny policy whose character vocabulary is `ab` and the separators (so random completions are full of
    them), prompts that hold every separator, and the arguments of a 4-step run recording every completion."""
    from rloo_jax.models import init_causal_lm, save_pretrained

    d = tmp_path_factory.mktemp("separators")
    chars = "ab" + SEPARATOR_CHARS
    config = dict(demo.MODEL_CONFIG, vocab_size=len(demo.SPECIAL_TOKENS) + len(chars))
    save_pretrained(init_causal_lm(config, seed=0), d / "model", tokenizer=demo.build_tokenizer(chars))
    rows = [{"prompt": f"{i}{''.join(SEPARATORS)}:"} for i in "ab" * 8]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # ASCII escapes: one row a line
    return [
        "--model_name_or_path", str(d / "model"), "--dataset_name", str(d / "data.jsonl"), "--reward_funcs",
        "tests.test_reliability:separators_reward", "--max_steps", "4", "--save_steps", "2", "--logging_steps",
        "1", "--log_completions", "true", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "8", "--max_prompt_length", "8", "--eval_steps", "None", "--full_determinism",
        "true",
    ]  # fmt: skip


def test_records_holding_line_separators_survive_kill_and_resume(separators_run, cache, tmp_path):
    """SIGKILL after the first checkpoint (step 2) once step 3 is logged, then resume: metrics.jsonl and
    rollouts.jsonl hold every record once, rollouts.jsonl byte-identical to an uninterrupted run's, though
    prompts, completions, extra columns and metric names hold every character str.splitlines splits on. The
    resumed run reads every program from the compilation cache (it used to compile its first step again)."""
    # JAX_EXPLAIN_CACHE_MISSES: JAX logs every program it compiles instead of reading it from the compilation cache
    straight = Launch(tmp_path / "straight", cache, tmp_path / "straight", separators_run, JAX_EXPLAIN_CACHE_MISSES="1")
    assert straight.wait() == 0, straight.output()[1][-3000:]
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_update'" in straight.output()[1]  # compiled here first
    out = tmp_path / "run"
    kill_when(out, cache, tmp_path / "killed", separators_run, step_after_checkpoint(out, 3, 2))
    assert checkpoint_names(out) == ["2"]
    last = Launch(out, cache, tmp_path / "last", separators_run, JAX_EXPLAIN_CACHE_MISSES="1")
    assert last.wait() == 0, last.output()[1][-3000:]
    assert "Resuming from checkpoint" in last.output()[0] and "dropped" in last.output()[0]
    # the resumed run compiled nothing: every program (sampler, reference pass, update) came from the cache the
    # straight run filled (a restored state is committed to its device; so is a fresh one, or they lower apart)
    assert "PERSISTENT COMPILATION CACHE MISS" not in last.output()[1], last.output()[1][-3000:]

    rollouts = read_jsonl(out / "rollouts.jsonl")
    assert [r["step"] for r in rollouts] == [s for s in (1, 2, 3, 4) for _ in range(8)]
    assert (out / "rollouts.jsonl").read_bytes() == (tmp_path / "straight" / "rollouts.jsonl").read_bytes()
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert without_wall_time(metrics) == without_wall_time(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    assert all(r["metric\u2029\x85name"] == 0.5 for r in metrics)
    # the records hold every separator: in prompts, completions (sampled), the extra column's name and values
    assert all(r["prompt"][1:-1] == "".join(SEPARATORS) for r in rollouts)
    completions = "".join(r["completion"] for r in rollouts)
    assert set(SEPARATOR_CHARS) <= set(completions), sorted(set(SEPARATOR_CHARS) - set(completions))
    assert all(r["extra"]["extra\u2028column\r\n"].endswith("|".join(SEPARATORS)) for r in rollouts)


# LoRA: adapters on every projection with dropout (its masks come from seed and step), the base as the reference
LORA_RUN = [*RUN[: RUN.index("--sync_ref_model")], "--use_peft", "--lora_target_modules", "all-linear",
            "--lora_dropout", "0.1", "--lora_r", "4", "--full_determinism", "true"]


def test_killed_lora_runs_resume_bit_identical(cache, tmp_path):
    straight = Launch(tmp_path / "straight", cache, tmp_path / "straight", LORA_RUN)
    assert straight.wait() == 0, straight.output()[1][-3000:]
    out = tmp_path / "run"
    for i, condition in enumerate([logged(out, 6), saving(out, 8)]):
        kill_when(out, cache, tmp_path / f"log{i}", LORA_RUN, condition)
    last = Launch(out, cache, tmp_path / "last", LORA_RUN)
    assert last.wait() == 0, last.output()[1][-3000:]
    assert "Resuming from checkpoint" in last.output()[0]
    adapter = "final/adapter_model.safetensors"
    assert sha256(out / adapter) == sha256(tmp_path / "straight" / adapter)
    assert without_wall_time(read_jsonl(out / "metrics.jsonl")) == without_wall_time(
        read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    assert read_jsonl(out / "rollouts.jsonl") == read_jsonl(tmp_path / "straight" / "rollouts.jsonl")
    # a LoRA checkpoint holds the adapters and their AdamW moments, not the frozen base: no base weight is listed
    listed = (out / "checkpoints" / "12" / "state" / "_METADATA").read_text()
    assert "lora_b" in listed and not any(name in listed for name in ("kernel", "embedding", "scale"))


# an optimizer step spanning two generation batches (steps_per_generation 3, gradient_accumulation_steps 2): the
# checkpoints after generations 1 and 3 (steps 1 and 4) hold a carried micro-batch's gradients (TrainState.grad_acc)
ACCUM_RUN = [
    "--max_steps", "6", "--save_steps", "1", "--logging_steps", "1", "--per_device_train_batch_size", "4",
    "--num_generations", "4", "--steps_per_generation", "3", "--gradient_accumulation_steps", "2",
    "--max_completion_length", "6", "--max_prompt_length", "5", "--full_determinism", "true",
    "--reward_funcs", "rloo_jax.demo:letters_reward",
]  # fmt: skip


def test_killed_runs_resume_a_carried_step_bit_identical(cache, tmp_path):
    """SIGKILL once step 2 is logged, then once checkpoint 4 (one micro-batch carried) is complete; the last run
    resumes from checkpoint 4 and ends with the uninterrupted run's weights and records."""
    straight = Launch(tmp_path / "straight", cache, tmp_path / "straight", ACCUM_RUN)
    assert straight.wait() == 0, straight.output()[1][-3000:]
    out = tmp_path / "run"
    for i, condition in enumerate([logged(out, 2), lambda: "4" in checkpoint_names(out)]):
        kill_when(out, cache, tmp_path / f"log{i}", ACCUM_RUN, condition)
    last = Launch(out, cache, tmp_path / "last", ACCUM_RUN)
    assert last.wait() == 0, last.output()[1][-3000:]
    assert re.findall(r"Resuming from checkpoint .*/(\d+) ", last.output()[0]) == ["4"]
    model = "final/model.safetensors"
    assert sha256(out / model) == sha256(tmp_path / "straight" / model)
    got = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 6]  # the last: the final evaluation
    assert without_wall_time(got) == without_wall_time(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


# ------------------------------------------------------------------------------------------------ non-finite
def extreme_reward(completions, **kwargs):
    """Finite rewards whose leave-one-out advantages overflow float32: non-finite loss and gradients."""
    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]


SMALL = [
    "--per_device_train_batch_size", "16", "--num_generations", "4", "--max_completion_length", "4",
    "--eval_steps", "None", "--compilation_cache", "false", "--logging_steps", "1",
    "--reward_funcs", "rloo_jax.demo:letters_reward",  # a dense reward: updates that move the policy
]  # fmt: skip


def test_optimizer_skips_non_finite_updates_and_counts_them():
    """The skip for an accelerator (elementwise selects) and the CPU one (optax.apply_if_finite) give the same
    state tree (a checkpoint moves between them) and bit-identical parameters, moments and counts."""
    cfg = load_config(["--learning_rate", "0.1"], base=demo.DEFAULT_CONFIG)
    opts = {p: make_optimizer(cfg, total_steps=10, platform=p) for p in ("cpu", "tpu")}
    params = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    states = {p: opt.init(params) for p, opt in opts.items()}
    assert jax.tree.structure(states["cpu"]) == jax.tree.structure(states["tpu"])
    good = {"w": jnp.full((2, 2), 0.5), "b": jnp.ones(2)}
    bad = {"w": jnp.array([[1.0, jnp.nan], [0.0, 0.0]]), "b": jnp.array([jnp.inf, 0.0])}
    for grads, expect in ((good, (0, 0)), (bad, (1, 1)), (bad, (2, 2)), (good, (0, 2))):
        after = {}
        for p, opt in opts.items():
            state = states[p]
            updates, new_state = jax.jit(opt.update)(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            if grads is bad:  # the update is a no-op: params and AdamW moments kept
                assert jax.tree.all(jax.tree.map(jnp.array_equal, new_params, params))
                assert jax.tree.all(jax.tree.map(jnp.array_equal, new_state.inner_state, state.inner_state))
            else:
                assert not jnp.array_equal(new_params["w"], params["w"])
            assert skipped_updates(new_state) == expect
            after[p] = (new_params, new_state)
        assert jax.tree.all(jax.tree.map(jnp.array_equal, after["cpu"], after["tpu"]))
        params = after["cpu"][0]
        states = {p: after[p][1] for p in opts}
    assert not nonfinite_leaves((params, states["cpu"]))


@pytest.mark.cpu_only(reason="its trigger, float32 overflow of the leave-one-out sums of +-3e38 rewards, follows "
                              "XLA:CPU's summation order; on an H200 (2026-11-28) the same run's updates came out "
                              "finite (advantages 0, grad norm 0): nothing to skip")
def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--max_steps", "8", "--save_steps", "1", "--max_consecutive_nonfinite", "3"]
    rc = main([*args, *SMALL, "--reward_funcs", "tests.test_reliability:extreme_reward"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "3 consecutive optimizer updates had a non-finite loss or gradients" in err and "Traceback" not in err
    assert "--learning_rate" in err and "the last checkpoint is intact" in err
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["skipped_steps"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] is None or r["grad_norm"] is None for r in rows)  # NaN logged as null
    assert not os.path.exists(out / "final")
    ckpt = Checkpointer(out / "checkpoints")
    try:
        assert ckpt.all_steps() == [1, 2]  # the failing step 3 wrote nothing
        cfg = load_config(args + SMALL, base=demo.DEFAULT_CONFIG)
        initial = nnx.state(load_causal_lm(demo_model_dir(0), **model_options(cfg, "cpu")), nnx.Param)
        like = make_like(cfg, initial)
        state, _, meta = ckpt.restore(2, like, jax.random.key(0))
        assert not nonfinite_leaves(state) and skipped_updates(state.opt_state) == (2, 2)
        # every update was skipped: the checkpointed policy is still the initial one
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(initial), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert meta["counters"]["num_tokens"] > 0
    finally:
        ckpt.close()


def demo_model_dir(seed):
    from rloo_jax import demo
    from rloo_jax.demo import CACHE_ROOT

    return demo.model_dir(CACHE_ROOT, seed)


def make_like(cfg, params):
    opt = make_optimizer(cfg, cfg.max_steps)
    ref = jax.tree.map(jnp.copy, params) if cfg.beta > 0 else None
    return TrainState(params=params, opt_state=opt.init(params), ref_params=ref, step=jnp.zeros((), jnp.int32))


def test_checkpoint_and_export_refuse_non_finite_values(tmp_path):
    params = {"w": jnp.ones((2, 2)), "b": jnp.array([1.0, jnp.nan]), "n": jnp.array([3], jnp.int32)}
    assert nonfinite_leaves(params) == ["['b']"]
    assert nonfinite_leaves({"w": jnp.array([jnp.inf])}) == ["['w']"] and nonfinite_leaves({"i": jnp.ones(2)}) == []
    ckpt = Checkpointer(tmp_path / "c")
    try:
        state = TrainState(params=params, opt_state=(), ref_params=None, step=jnp.zeros((), jnp.int32))
        with pytest.raises(NonFiniteError, match=r"refusing to save checkpoint 3: non-finite values in .*\['b'\]"):
            ckpt.save(3, state, jax.random.key(0), {"step": 3})
        ckpt.wait()
        assert ckpt.all_steps() == [] and os.listdir(tmp_path / "c") == []
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------------------------ determinism
def test_same_config_and_seed_give_identical_metrics(tmp_path):
    args = [*SMALL, "--max_steps", "3", "--save_steps", "3", "--log_completions", "true", "--full_determinism", "true"]
    for name in ("a", "b"):
        assert main([*args, "--output_dir", str(tmp_path / name)]) == 0
    a, b = (read_jsonl(tmp_path / n / "metrics.jsonl") for n in "ab")
    assert len(a) == 3 and without_wall_time(a) == without_wall_time(b)
    assert read_jsonl(tmp_path / "a" / "rollouts.jsonl") == read_jsonl(tmp_path / "b" / "rollouts.jsonl")
    assert sha256(tmp_path / "a/final/model.safetensors") == sha256(tmp_path / "b/final/model.safetensors")


# ------------------------------------------------------------------------------------------------ records, window
def test_drop_records_after_drops_later_steps_and_a_torn_last_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "x": 1.5}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x": 0.')
    assert drop_records_after(p, 2) == 2  # step 3 and the torn step-4 line
    assert p.read_text() == '{"step": 1, "x": 1.5}\n{"step": 2}\n'
    assert drop_records_after(p, 2) == 0 and drop_records_after(tmp_path / "missing.jsonl", 0) == 0
    assert drop_records_after(p, 0) == 2 and p.read_text() == ""


def test_log_window_state_round_trip_is_exact():
    """The unread window travels as JSON in the checkpoint's meta: a resumed window logs the same means, NaN kept
    out of them, grad_norm the last value."""
    w = LogWindow()
    w.add({"a": [0.1, float("nan")], "b": [float("nan")], "grad_norm": [2.0]})
    w.add({"a": [1 / 3], "b": [float("inf")], "grad_norm": [5.0]})
    state = json.loads(json.dumps(w.state_dict()))
    again = LogWindow()
    again.load_state_dict(state)
    for x in (w, again):
        x.add({"a": [7.0], "grad_norm": [3.0]})
    got, want = again.read(), w.read()
    assert got == want == {"a": (0.1 + 1 / 3 + 7.0) / 3, "b": float("inf"), "grad_norm": 3.0}
    assert w.read() == {} and LogWindow().state_dict() == {"values": {}}


def test_log_window_steps_split_a_generation_batch_as_trl_logs_it():
    """Generation metrics once (with the first optimizer step), micro-batch values per step, update values per step."""
    metrics = {"generation": {"reward": np.float32(1.0)}, "micro": {"kl": np.array([[1.0, 2.0], [3.0, 4.0]])},
               "update": {"loss": np.array([5.0, 6.0])}}
    assert list(steps(metrics)) == [{"reward": [1.0], "kl": [1.0, 2.0], "loss": [5.0]},
                                    {"kl": [3.0, 4.0], "loss": [6.0]}]
    w = LogWindow()
    w.add({"kl": [1.0, float("nan"), 3.0], "grad_norm": [2.0, 5.0], "clip": [float("nan")]})
    assert w.read() == {"kl": 2.0, "grad_norm": 5.0, "clip": None}


# ------------------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Broken files and model folders, each meant to be refused before anything is written."""
    from rloo_jax.models import save_pretrained

    d = tmp_path_factory.mktemp("bad")
    (d / "empty.jsonl").write_text("")
    (d / "header_only.csv").write_text("prompt,answer\n")
    (d / "noprompt.jsonl").write_text('{"question": "abc:"}\n' * 40)
    (d / "bad.yaml").write_text("seed: [1, 2\n")
    (d / "code.yaml").write_text(f"seed: !!python/object/apply:os.system ['touch {d}/SENTINEL']\n")
    tok = demo.build_tokenizer()
    model = load_causal_lm(demo.prepare_model(str(d / "demo_model"), seed=0))
    for name in ("bert", "bin", "custom"):
        save_pretrained(model, d / name, tokenizer=tok)
    cfg = json.loads((d / "bert" / "config.json").read_text())
    (d / "bert" / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertModel"], "model_type": "bert"}))
    os.replace(d / "bin" / "model.safetensors", d / "bin" / "pytorch_model.bin")
    (d / "custom" / "tokenizer.json").unlink()  # only the shipped code could build this tokenizer
    tc = json.loads((d / "custom" / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (d / "custom" / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "custom" / "evil.py").write_text(f"open({str(d / 'SENTINEL')!r}, 'w').close()\n")
    shutil.copytree(d / "custom", d / "custom_rm")  # the same tokenizer on a reward model's config
    rm = json.loads((d / "custom_rm" / "config.json").read_text())
    (d / "custom_rm" / "config.json").write_text(json.dumps({**rm, "architectures": ["Qwen2ForSequenceClassification"],
                                                             "num_labels": 1}))
    return d


MODEL_ARGS = ["--dataset_name", "demo", "--reward_funcs", "rloo_jax.demo:letters_reward"]
BAD = [
    (["--dataset_name", "{d}/empty.jsonl"], r"dataset .*empty\.jsonl.* is empty"),
    (["--dataset_name", "{d}/header_only.csv"], r"dataset .*header_only\.csv.* is empty"),
    (["--dataset_name", "{d}/noprompt.jsonl"], r"no `prompt` column \(columns: question\); rename"),
    (["--dataset_name", "{d}/missing.jsonl"], r"missing\.jsonl: no such file"),
    (["--lerning_rate", "1"], "unknown option .*did you mean --learning_rate"),
    (["--config", "{d}/bad.yaml"], r"bad\.yaml is not valid YAML"),
    (["--config", "{d}/code.yaml"], r"code\.yaml is not valid YAML"),  # the safe loader: no python tags
    (["--learning_rate", "-1"], "learning_rate must be > 0"),
    (["--learning_rate", "inf"], "learning_rate must be a finite number"),
    (["--temperature", "-0.5"], "temperature must be >= 0"),
    (["--top_p", "1.5"], r"top_p must be in \(0, 1\]"),
    (["--epsilon", "0"], "epsilon must be > 0"),
    (["--max_completion_length", "0"], "max_completion_length must be >= 1"),
    (["--max_prompt_length", "0"], "max_prompt_length must be >= 1"),
    (["--max_consecutive_nonfinite", "0"], "max_consecutive_nonfinite must be >= 1"),
    (["--per_device_train_batch_size", "10"], "must be divisible by num_generations = 4"),
    (["--reward_weights", "1,2"], r"Number of reward weights \(2\) must match number of reward functions \(1"),
    (["--reward_funcs", "nosuch_mod_q:f"], "cannot import 'nosuch_mod_q'"),
    (["--reward_funcs", "rloo_jax.demo:nosuch"], "has no callable 'nosuch'"),
    (["--model_name_or_path", "{d}/nosuch", *MODEL_ARGS], "checkpoint path does not exist: .*nosuch"),
    (["--model_name_or_path", "{d}/bert", *MODEL_ARGS], "unsupported architecture 'BertModel'"),
    (["--model_name_or_path", "{d}/bin", *MODEL_ARGS], r"no \*\.safetensors weights"),
    (
        ["--model_name_or_path", "{d}/custom", "--trust_remote_code", "true", *MODEL_ARGS],
        "needs code shipped with the model .*never runs such code",
    ),
    (["--reward_model_name_or_path", "{d}/custom_rm"], r"the tokenizer in .*custom_rm needs code shipped with"),
    (["--reward_model_name_or_path", "{d}/custom"], r"custom holds Qwen2ForCausalLM, not a reward model"),
]


@pytest.mark.parametrize("args, message", BAD, ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else None)
def test_bad_invocations_exit_2_with_one_message_and_touch_nothing(reference, bad_inputs, capsys, args, message):
    """Each on the finished reference run's output_dir: its checkpoints and files stay byte- and mtime-equal."""
    before = snapshot(reference)
    args = [a.format(d=bad_inputs) for a in args]
    common = [*RUN, "--output_dir", str(reference), "--compilation_cache", "false"]
    assert main([*common, *args]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(message, errors[0]), err
    assert "Traceback" not in err
    assert snapshot(reference) == before
    assert not os.path.exists(bad_inputs / "SENTINEL")  # no shipped or YAML-embedded code ran
