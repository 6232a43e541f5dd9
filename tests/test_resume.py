"""What a run records of itself and what a resume does with it: local paths absolute in config.yaml and the
checkpoint's meta, a local-looking path that does not exist is an error (not a hub download), and resuming with
changed options says what each change does or refuses it (rloo_jax.resume)."""

import json
import os
import re
import shutil

import pytest
import yaml

from rloo_jax import demo
from rloo_jax.build import local_dataset
from rloo_jax.cli import main
from rloo_jax.config import absolute_paths
from rloo_jax.demo import CACHE_ROOT
from rloo_jax.errors import ConfigError, DataError, command_line
from rloo_jax.export import main as export_main
from rloo_jax.models import ModelLoadError
from rloo_jax.models.hf import resolve_checkpoint
from rloo_jax.outputs import is_local_path
from rloo_jax.resume import Change, changes, describe, learning_rate_at

BASE = {"model_name_or_path": "/m", "seed": 0, "max_steps": 300, "num_train_epochs": 3.0, "learning_rate": 1e-3,
        "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "warmup_steps": 0, "beta": 0.02, "max_grad_norm": 1.0,
        "per_device_train_batch_size": 64, "temperature": 1.0, "output_dir": "/out", "remat_policy": None,
        "reward_funcs": ["m:f"], "reward_clip_range": None}


# ------------------------------------------------------------------------------------------------ the rule table
def test_unchanged_options_report_nothing():
    assert changes(BASE, dict(BASE), 100, 300, 300) == [] and describe([], 100) == []
    # where the run lives may move; an option the saved run did not have (a newer version) is not compared
    assert changes(BASE, {**BASE, "output_dir": "/elsewhere", "new_option": 1}, 100, 300, 300) == []


def test_a_longer_run_rescales_the_learning_rate_schedule():
    # linear decay over 300 steps: lr(100) = 1e-3 * 200/300; over 600: 1e-3 * 500/600
    assert learning_rate_at(BASE, 100, 300) == pytest.approx(1e-3 * 2 / 3)
    (change,) = changes(BASE, {**BASE, "max_steps": 600}, 100, 300, 600)
    assert change == Change("max_steps", 300, 600, "the run now ends at step 600 (was 300); the learning-rate "
                            "schedule is recomputed for 600 steps; the learning rate at step 100 goes from 0.000667 "
                            "to 0.000833")
    assert describe([change], 100) == ["Changed since checkpoint 100:", f"  max_steps 300 -> 600: {change.effect}"]
    constant = {**BASE, "lr_scheduler_type": "constant"}
    (change,) = changes(constant, {**constant, "max_steps": 600}, 100, 300, 600)
    assert change.effect.endswith("the learning rate at step 100 stays 0.001")
    # num_train_epochs does nothing while max_steps is set
    (change,) = changes(BASE, {**BASE, "num_train_epochs": 5.0}, 100, 300, 300)
    assert change.effect == "the total step count is unchanged"


def test_learning_rate_options_and_others_apply_from_the_resumed_step():
    found = changes(BASE, {**BASE, "learning_rate": 5e-4, "temperature": 0.7, "beta": 0.05, "max_grad_norm": 0.5,
                           "remat_policy": "full", "per_device_train_batch_size": 32}, 100, 300, 300)
    effects = {c.option: c.effect for c in found}
    assert effects["learning_rate"] == ("the learning-rate schedule is recomputed for 300 steps; the learning rate "
                                        "at step 100 goes from 0.000667 to 0.000333")
    assert effects["temperature"] == effects["beta"] == effects["max_grad_norm"] == "applies from this step"
    assert effects["remat_policy"].startswith("execution only")
    assert effects["per_device_train_batch_size"].startswith("applies from this step: the data continues")
    assert [c.line() for c in found if c.option == "remat_policy"] == [
        "remat_policy none -> \"full\": execution only, from this step (the same numbers up to float rounding)"]
    # under num_train_epochs a batch change moves the total: reported, with the schedule
    (batch, total) = changes(BASE, {**BASE, "per_device_train_batch_size": 32}, 100, 300, 600)
    assert total.option == "total steps" and "the run now ends at step 600" in total.effect


def test_options_that_cannot_be_honoured_are_refused_together():
    with pytest.raises(ConfigError) as e:
        changes(BASE, {**BASE, "seed": 1, "model_name_or_path": "/n", "temperature": 0.5}, 100, 300, 300)
    message = str(e.value)
    assert message.startswith("cannot resume checkpoint 100 with ")
    assert 'model_name_or_path "/m" -> "/n" (the checkpoint holds the weights trained from it' in message
    assert "seed 0 -> 1 (the data order" in message and "temperature" not in message
    # named as the reader writes them: Python arguments here, flags from the command line
    assert "resume with model_name_or_path='/m', seed=0, or start a new output_dir" in message
    with command_line(), pytest.raises(ConfigError) as e:
        changes(BASE, {**BASE, "seed": 1, "model_name_or_path": "/n"}, 100, 300, 300)
    assert "resume with --model_name_or_path /m --seed 0, or start a new output_dir" in str(e.value)
    for option, old, new in [("beta", 0.02, 0.0), ("max_grad_norm", 1.0, 0.0)]:
        with pytest.raises(ConfigError, match=f"with {option} "):
            changes(BASE, {**BASE, option: new}, 100, 300, 300)
        assert old != new
    # another reward function in place of one is honoured; another number of them is not
    (change,) = changes(BASE, {**BASE, "reward_funcs": ["m:g"]}, 100, 300, 300)
    assert change.effect.startswith("the reward changes from this step")
    with pytest.raises(ConfigError, match=r"reward_funcs=\['m:f'\]"):
        changes(BASE, {**BASE, "reward_funcs": ["m:f", "n:g"]}, 100, 300, 300)


# ------------------------------------------------------------------------------------------------ the path rule
def test_local_looking_paths_never_go_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ("./m", "../m", "/abs/m", "~/m", ".m", "runs/m", "a/b/c", "a b", "a--b", "a..b", "runs"):
        assert is_local_path(name), name
    for name in ("gpt2", "Qwen/Qwen2.5-0.5B", "trl-lib/tldr", "EleutherAI/pythia-1b-deduped"):
        assert not is_local_path(name), name
    # a missing local path is an error naming it; a hub id goes to the hub (offline here: its own error)
    for name in ("./nosuch", "runs/nosuch", "~/nosuch_rloo_jax_model"):
        with pytest.raises(ModelLoadError, match=f"checkpoint path does not exist: {name} "):
            resolve_checkpoint(name)
    with pytest.raises(ModelLoadError, match="no such local directory and hub download failed"):
        resolve_checkpoint("someorg/nosuch-model")
    with pytest.raises(DataError, match=r"dataset runs/nosuch: no such file or folder \(.*runs/nosuch;"):
        local_dataset("runs/nosuch")
    assert local_dataset("someorg/some-dataset") == "someorg/some-dataset" and local_dataset("tfds:x") == "tfds:x"
    (tmp_path / "runs" / "d.jsonl").write_text("{}\n")
    assert local_dataset("runs/d.jsonl") == "runs/d.jsonl"


def test_absolute_paths_of_a_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "t.jsonl").write_text("{}\n")
    values = {"model_name_or_path": "./m", "dataset_name": "demo", "reward_model_name_or_path": ["m", "org/rm"],
              "dataset_train_split": "train", "dataset_test_split": "t.jsonl", "tfds_data_dir": None,
              "output_dir": "gs://b/run", "seed": 3}
    assert absolute_paths(values) == {**values, "model_name_or_path": str(tmp_path / "m"), "reward_model_name_or_path":
                                      [str(tmp_path / "m"), "org/rm"], "dataset_test_split": str(tmp_path / "t.jsonl")}


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow  # two short runs, each compiling its step, and an export (~25 s; ~95 s on the loaded machine)
def test_config_yaml_records_absolute_paths_and_a_resume_reports_changes(tmp_path, monkeypatch, capsys):
    """A run started with relative paths records them absolute (config.yaml and the checkpoint), so it resumes
    and exports from another folder; a resume with a longer max_steps and a new learning rate says what they do,
    one with another seed is refused before anything is touched."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shutil.copytree(demo.prepare_model(demo.model_dir(CACHE_ROOT, 0), 0), work / "model")
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demo.make_rows(32, seed=0)))
    reward = work / "reward.py"
    reward.write_text("from rloo_jax.demo import letters_reward\n\n\ndef reward(completions, **kwargs):\n"
                      "    return letters_reward(completions, **kwargs)\n")
    run = ["--model_name_or_path", "./model", "--dataset_name", "data.jsonl", "--reward_funcs",
           "reward.py:reward", "--output_dir", "out", "--per_device_train_batch_size", "16",
           "--num_generations", "4", "--max_completion_length", "4", "--eval_steps", "None", "--logging_steps", "1",
           "--save_steps", "2", "--compilation_cache", "false", "--lr_scheduler_type", "linear"]
    assert main([*run, "--max_steps", "2"]) == 0
    saved = yaml.safe_load((work / "out" / "config.yaml").read_text())
    assert (saved["model_name_or_path"], saved["dataset_name"], saved["output_dir"]) == (
        str(work / "model"), str(work / "data.jsonl"), str(work / "out"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert export_main([str(work / "out"), "exported"]) == 0  # the base found at its recorded absolute path
    assert (elsewhere / "exported" / "model.safetensors").is_file()

    monkeypatch.chdir(work)
    capsys.readouterr()
    reward.write_text(reward.read_text().replace("return letters_reward(completions, **kwargs)",
                                                 "return [2 * r for r in letters_reward(completions, **kwargs)]"))
    assert main([*run, "--max_steps", "4", "--learning_rate", "5e-4"]) == 0
    out = capsys.readouterr().out
    # linear decay: lr(2) over 2 steps = 0; over 4 steps at 5e-4 = 5e-4 * 2/4
    assert ("Changed since checkpoint 2:\n"
            "  learning_rate 1e-06 -> 0.0005: the learning-rate schedule is recomputed for 4 steps; the learning rate "
            "at step 2 goes from 0 to 0.00025\n"
            "  max_steps 2 -> 4: the run now ends at step 4 (was 2); the learning-rate schedule is recomputed for 4 "
            "steps; the learning rate at step 2 goes from 0 to 0.00025\n") in out, out
    assert re.search(r"  reward function 'reward' \"[0-9a-f]{16}\" -> \"[0-9a-f]{16}\": its source \(hashed\) was "
                     r"edited since the checkpoint's run; rewards from this step come from the new code\n", out), out
    logged = [r for r in map(json.loads, (work / "out" / "metrics.jsonl").read_text().splitlines())]
    assert [r["step"] for r in logged] == [1, 2, 3, 4] and logged[2]["learning_rate"] == pytest.approx(2.5e-4)
    # config.yaml: the options of steps 3-4, after what steps 1-2 used (YAML comments: it still loads as a config)
    text = (work / "out" / "config.yaml").read_text()
    assert text.startswith("# resumed at step 2: learning_rate 1e-06 -> 0.0005\n"
                           "# resumed at step 2: max_steps 2 -> 4\n"
                           "# resumed at step 2: reward function 'reward' \""), text[:400]
    assert (yaml.safe_load(text)["max_steps"], yaml.safe_load(text)["learning_rate"]) == (4, 5e-4)

    before = {p: os.path.getmtime(p) for p in map(str, (work / "out").rglob("*"))}
    assert main([*run, "--max_steps", "6", "--learning_rate", "5e-4", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot resume checkpoint 4 with seed 42 -> 1 (the data order") and "--seed 42" in err
    assert {p: os.path.getmtime(p) for p in map(str, (work / "out").rglob("*"))} == before


@pytest.mark.slow  # two short runs of the demo model, the second from the suite's compilation cache (~20 s)
def test_a_resume_with_only_max_steps_changed_compiles_nothing(tmp_path, monkeypatch):
    """The learning-rate schedule's horizon (warmup and total steps) is an argument of the update program, not a
    constant in it: a run resumed with a longer max_steps (linear decay after a warmup, so every step's rate moves)
    takes every program from the compilation cache (0 XLA compiles; before, the update recompiled: 52 s on CPU for
    the demo) and logs the rates of the new horizon."""
    import jax

    from tests.test_compile import CACHE_HIT, COMPILE

    monkeypatch.chdir(tmp_path)
    shutil.copytree(demo.prepare_model(demo.model_dir(CACHE_ROOT, 0), 0), tmp_path / "model")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demo.make_rows(16, seed=0)))
    run = ["--model_name_or_path", "model", "--dataset_name", "data.jsonl", "--reward_funcs",
           "rloo_jax.demo:letters_reward", "--output_dir", "out", "--per_device_train_batch_size", "8",
           "--num_generations", "4", "--max_completion_length", "4", "--eval_steps", "None", "--logging_steps", "1",
           "--lr_scheduler_type", "linear", "--warmup_steps", "0.5", "--learning_rate", "1e-3"]
    counts = {"compiles": 0, "hits": 0}  # a hit is counted in both: jax times the cache read as a compile

    def compiled(event: str, duration: float, **kwargs: object) -> None:
        counts["compiles"] += event == COMPILE

    def hit(event: str, **kwargs: object) -> None:
        counts["hits"] += event == CACHE_HIT

    jax.monitoring.register_event_duration_secs_listener(compiled)
    jax.monitoring.register_event_listener(hit)
    try:
        assert main([*run, "--max_steps", "2"]) == 0
        first = dict(counts)
        assert main([*run, "--max_steps", "6"]) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
        jax.monitoring.unregister_event_listener(hit)
    resumed = {k: counts[k] - first[k] for k in counts}
    logged = [json.loads(line)["learning_rate"] for line in (tmp_path / "out" / "metrics.jsonl").open()]
    # first run: warmup ceil(0.5 x 2) = 1 step, then the decay; resumed over 6 steps: warmup 3, decay over 3
    assert logged == pytest.approx([0.0, 1e-3, 2e-3 / 3, 1e-3, 2e-3 / 3, 1e-3 / 3]), logged
    assert first["compiles"] > first["hits"] and resumed["hits"] > 0, (first, resumed)  # the counters count
    assert resumed["compiles"] == resumed["hits"], (first, resumed)  # every program from the cache
