"""What a TRL user reads from and plugs into a trainer: transformers-style callbacks (events, control flags, a
callback that raises), `train()`'s `TrainOutput` and the end-of-training record, `evaluate()` with named sets, and
the trainer's attributes (models, tokenizers, reward functions, state, args)."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import datasets
import pytest
import yaml

import rloo_jax
from rloo_jax import demo
from rloo_jax.callbacks import CallbackError
from rloo_jax.errors import ConfigError
from rloo_jax.metrics import read_jsonl

SETTINGS = dict(
    per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_prompt_length=16, prompt_bucket=8,
    learning_rate=1e-3, lr_scheduler_type="constant", beta=0.02, seed=0, logging_steps=2, save_steps=100,
    compilation_cache=False, report_to="none",
)


def first_letter(completions, **kwargs):
    return [float(bool(c) and c[0] in "abc") for c in completions]


def rows(n=16):
    return demo.make_rows(n, seed=0)


class Recorder:
    """A duck-typed callback (transformers' TrainerCallback has the same methods) recording every event."""

    def __init__(self, stop_at=None, raise_at=None):
        self.events, self.stop_at, self.raise_at = [], stop_at, raise_at

    def __getattr__(self, event):
        if not event.startswith("on_"):
            raise AttributeError(event)

        def call(args, state, control, **kwargs):
            self.events.append((event, state.global_step))
            if event == "on_step_end" and state.global_step == self.raise_at:
                raise ValueError("boom")
            if event == "on_step_end" and state.global_step == 3:
                control.should_log = True  # an off-cadence record
                control.should_save = True
            if event == "on_step_end" and state.global_step == self.stop_at:
                control.should_training_stop = True
            return control

        return call


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run: 2 generation batches of 2 optimizer steps (steps_per_generation 2), a callback that forces a log
    and a save at step 3 and stops training after step 3's generation batch (step 4)."""
    out = tmp_path_factory.mktemp("surface") / "run"
    rec = Recorder(stop_at=3)
    args = rloo_jax.RLOOConfig(output_dir=str(out), max_steps=10, steps_per_generation=2, push_to_hub=False,
                               **SETTINGS)
    trainer = rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=rows(),
                                   eval_dataset={"a": rows(8), "b": rows(4)}, callbacks=[rec])
    output = trainer.train()
    return trainer, output, rec, out


def test_callback_events_and_control_flags(run):
    trainer, output, rec, out = run
    names = [e for e, _ in rec.events]
    assert names[:2] == ["on_init_end", "on_train_begin"] and names[-1] == "on_train_end"
    ends = [step for e, step in rec.events if e == "on_step_end"]
    assert ends == [1, 2, 3, 4]  # stopped after the generation batch holding step 3: its step 4 is done
    assert names.count("on_step_begin") == 4
    logged = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert logged == [2, 3, 4]  # logging_steps 2, step 3 forced by should_log, 4 the last
    assert os.listdir(out / "checkpoints") == ["4"]  # should_save at step 3 and the end: one save after step 4
    assert ("on_save", 4) in rec.events and os.path.isdir(out / "final")
    assert output.global_step == 4 and trainer.state.global_step == 4


def test_train_output_and_the_end_of_training_record(run):
    trainer, output, _, _ = run
    summary = trainer.state.log_history[-1]
    assert set(summary) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                            "train_loss", "epoch", "step"}
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert summary["step"] == 4 and output.training_loss == pytest.approx(summary["train_loss"])
    assert len(losses) == 3 and output.metrics["train_loss"] == summary["train_loss"]
    assert output.metrics["train_steps_per_second"] > 0
    # a resumed run already complete (its 4 steps done): no step, TRL's TrainOutput with loss 0
    args = rloo_jax.RLOOConfig(output_dir=trainer.args.output_dir, max_steps=4, steps_per_generation=2, **SETTINGS)
    again = rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=rows())
    assert again.train(resume_from_checkpoint=True).global_step == 4 and again.state.log_history
    newest = os.path.join(trainer.args.output_dir, "checkpoints", "4")
    done = again.train(resume_from_checkpoint=newest)  # the newest checkpoint named: the same
    assert done.global_step == 4 and done.training_loss == 0.0


def test_train_starts_over_unless_asked_to_resume(run, tmp_path):
    """transformers' rule: train() is a fresh run, which an output_dir holding another run's checkpoints refuses
    (naming both ways on); resume_from_checkpoint True or the newest checkpoint's path continues it."""
    trainer = run[0]
    out = trainer.args.output_dir
    args = rloo_jax.RLOOConfig(output_dir=out, max_steps=4, steps_per_generation=2, **SETTINGS)
    again = rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=rows())
    before = sorted(os.listdir(out))
    with pytest.raises(ConfigError, match=r"holds the checkpoints of an earlier run \(newest: step 4\): continue it "
                                          r"with train\(resume_from_checkpoint=True\), or start over in another "
                                          r"output_dir"):
        again.train()
    with pytest.raises(ConfigError, match=r"continues from the newest checkpoint of its args.output_dir \(.*/4\)"):
        again.train(resume_from_checkpoint=os.path.join(out, "checkpoints", "2"))
    assert sorted(os.listdir(out)) == before
    empty = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "new"), max_steps=4, **SETTINGS)
    with pytest.raises(ConfigError, match="holds no complete checkpoint: call train"):
        rloo_jax.RLOOTrainer("demo", first_letter, args=empty, train_dataset=rows()).train(resume_from_checkpoint=True)


def test_evaluate_named_sets(run):
    trainer, _, rec, out = run
    metrics = trainer.evaluate()
    assert {"eval_a_reward", "eval_b_reward", "eval_a_completions/mean_length"} <= set(metrics)
    assert not any(k.startswith("eval_reward") for k in metrics)
    assert any("eval_a_reward" in r for r in read_jsonl(out / "metrics.jsonl"))
    one = trainer.evaluate(eval_dataset=rows(4))
    assert "eval_reward" in one and 0.0 <= one["eval_reward"] <= 1.0


def test_what_trl_users_read_from_a_trainer(run):
    trainer, _, _, _ = run
    from rloo_jax.models import CausalLM

    assert isinstance(trainer.model, CausalLM)  # the trained policy, read from final/
    assert isinstance(trainer.ref_model, CausalLM)  # beta > 0, full fine-tuning
    assert trainer.processing_class.padding_side == "left"
    assert trainer.reward_funcs == [first_letter] and trainer.reward_processing_classes == [None]
    assert trainer.args.push_to_hub is False  # a TRL option without effect, still readable
    assert trainer.state.max_steps == 10 and trainer.state.log_history


def test_a_raising_callback_stops_with_its_name_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = rloo_jax.RLOOConfig(output_dir=str(out), max_steps=6, **dict(SETTINGS, save_steps=1))
    trainer = rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=rows(),
                                   callbacks=[Recorder(raise_at=3)])
    with pytest.raises(CallbackError, match=r"callback Recorder.on_step_end raised ValueError: boom; training "
                                            r"stopped at step 3"):
        trainer.train()
    assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]
    resumed = rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=rows()).train(
        resume_from_checkpoint=True)
    assert resumed.global_step == 6


def test_transformers_callbacks_work(tmp_path):
    transformers = pytest.importorskip("transformers")

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= 2:
                control.should_training_stop = True
            return control

    args = rloo_jax.GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=8, **SETTINGS)
    trainer = rloo_jax.GRPOTrainer("demo", first_letter, args=args, train_dataset=datasets.Dataset.from_list(rows()))
    trainer.add_callback(Stop)
    assert trainer.train().global_step == 2
    assert trainer.pop_callback(Stop) is not None


def test_datasets_and_args_as_trl_keeps_them():
    """`trainer.eval_dataset` is what was passed (one set or named sets), as transformers' Trainer keeps it; a
    stream to train on forces `dataloader_num_workers` to 0, as TRL does (one reader keeps the groups whole)."""
    ev = datasets.Dataset.from_list(rows(4))
    stream = datasets.Dataset.from_list(rows()).to_iterable_dataset()
    args = rloo_jax.RLOOConfig(output_dir="unused", max_steps=2, dataloader_num_workers=2, **SETTINGS)
    trainer = rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=stream, eval_dataset=ev)
    assert trainer.eval_dataset is ev and trainer.train_dataset is not None
    assert trainer.args.dataloader_num_workers == 0 and args.dataloader_num_workers == 2
    named = {"a": ev, "b": datasets.Dataset.from_list(rows(2))}
    mapped = rloo_jax.RLOOTrainer("demo", first_letter, args=replace(args, dataloader_num_workers=2),
                                  train_dataset=rows(), eval_dataset=named)
    assert mapped.eval_dataset is named and mapped.args.dataloader_num_workers == 2


def test_an_unknown_reward_name_fails_at_construction():
    """A reward name that is neither a built-in, a function nor a reward model fails in the constructor (TRL loads
    its reward models there), naming it; a function that cannot be imported too (issue 39, item 8)."""
    args = rloo_jax.RLOOConfig(output_dir="unused", max_steps=2, **SETTINGS)
    with pytest.raises(ConfigError, match="no_such_reward"):
        rloo_jax.RLOOTrainer("demo", ["format", "no_such_reward"], args=args, train_dataset=rows())
    with pytest.raises(ConfigError, match="no_such_module"):
        rloo_jax.RLOOTrainer("demo", "no_such_module:f", args=args, train_dataset=rows())
    assert rloo_jax.RLOOTrainer("demo", ["format", first_letter], args=args, train_dataset=rows()).args.reward_funcs


def test_epoch_strategies_and_ratio_steps_land_where_transformers_puts_them(tmp_path):
    """save_strategy / eval_strategy `epoch`: a checkpoint and an evaluation at each epoch's end (6 prompts, 2 a
    step: 3 steps an epoch, 2 epochs); logging_steps 0.5: every ceil(6 x 0.5) = 3 steps, as transformers'
    TrainerState.compute_steps resolves it, and config.yaml records the 3 the run used."""
    out = tmp_path / "epochs"
    settings = dict(SETTINGS, per_device_train_batch_size=4, num_generations=2, per_device_eval_batch_size=2,
                    logging_steps=0.5)
    args = rloo_jax.RLOOConfig(output_dir=str(out), num_train_epochs=2, save_strategy="epoch", eval_strategy="epoch",
                               **settings)
    assert rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=rows(6),
                                eval_dataset=rows(2)).train().global_step == 6
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [3, 6]
    assert [r["step"] for r in records if "eval_reward" in r] == [3, 6]
    assert sorted(os.listdir(out / "checkpoints"), key=int) == ["3", "6"]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["logging_steps"], saved["save_strategy"], saved["eval_strategy"]) == (3, "epoch", "epoch")


def test_an_epoch_a_step_spans_from_the_command_line(tmp_path, capsys):
    """The command line (YAML alike): 3 prompts, 1 a generation batch of 1 micro-batch, gradient_accumulation_steps
    2 -> 3/2 steps an epoch (a step spans two epochs), 3 epochs = 9 micro-batches = 4 steps: epoch e ends in step
    ceil(3e/2) = 2, 3 (and 5, past the end), where save_strategy epoch writes its checkpoints, and at the end (4);
    logging_steps 0.5 -> every ceil(4 x 0.5) = 2 steps. The run says where TRL's count differs (issue 39 item 11:
    its Trainer ends each epoch with a short step, 3 x ceil(3/2) = 6 steps)."""
    from rloo_jax.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(3)))
    out = tmp_path / "run"
    argv = ["--model_name_or_path", "demo", "--dataset_name", str(data), "--reward_funcs",
            "rloo_jax.demo:letters_reward", "--output_dir", str(out), "--num_train_epochs", "3",
            "--per_device_train_batch_size", "2", "--num_generations", "2", "--steps_per_generation", "1",
            "--gradient_accumulation_steps", "2", "--max_completion_length", "4", "--save_strategy", "epoch",
            "--logging_steps", "0.5", "--compilation_cache", "false"]
    assert main(argv) == 0
    assert ("note: an epoch is 3 micro-batches, not a multiple of gradient_accumulation_steps 2: TRL's Trainer ends "
            "each epoch with a short optimizer step (6 steps in all); here a step spans two epochs (4 steps)\n"
            ) in capsys.readouterr().out
    assert sorted(os.listdir(out / "checkpoints"), key=int) == ["2", "3", "4"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [2, 4]
    assert yaml.safe_load((out / "config.yaml").read_text())["logging_steps"] == 2


def test_epoch_strategies_need_epochs():
    """An IterableDataset (TRL: max_steps required) has no epochs: save_strategy / eval_strategy `epoch` fail in
    the constructor, naming the option and what to use."""
    stream = datasets.Dataset.from_list(rows()).to_iterable_dataset()
    for strategy in ("save_strategy", "eval_strategy"):
        args = rloo_jax.RLOOConfig(output_dir="unused", max_steps=2, **{strategy: "epoch"}, **SETTINGS)
        with pytest.raises(ConfigError, match=f"args.{strategy}='epoch' needs the length of an epoch, and an "
                                              "IterableDataset has none: the run is max_steps long; use "
                                              f"{strategy}='steps'"):
            rloo_jax.RLOOTrainer("demo", first_letter, args=args, train_dataset=stream, eval_dataset=rows(2))

    class Environment:  # TRL's environment_factory with no train_dataset: placeholder rows, no epochs either
        def reset(self, **kwargs):
            return "hi"

    args = rloo_jax.GRPOConfig(output_dir="unused", max_steps=2, save_strategy="epoch", **SETTINGS)
    with pytest.raises(ConfigError, match="args.save_strategy='epoch' needs the length of an epoch, and the "
                                          "environment owns the data"):
        rloo_jax.GRPOTrainer("demo", first_letter, args=args, environment_factory=Environment)


@pytest.mark.slow  # one Python process: three trainers, each stopped by its reward at the first step (~40 s)
def test_a_caught_reward_error_leaves_the_script_running(tmp_path):
    """Issue 39 item 2: a RewardError raised inside .train() (a reward returning text, raising, returning the wrong
    count) is an ordinary exception: a script that catches it goes on and exits 0. It used to end in `FATAL:
    exception not rethrown` and SIGABRT: the first step's update compiles in a thread beside the sampler, and a
    step that failed before joining it left it in XLA, where the interpreter's exit killed it. So: no thread of the
    trainer is left once train() has raised, and the process exits 0 (a fresh compilation cache: no compile hit)."""
    script = tmp_path / "script.py"
    script.write_text(f'''
import threading

import rloo_jax
from rloo_jax import demo
from rloo_jax.errors import RewardError

def text(completions, **kwargs):
    return ["bad"] * len(completions)

def raising(completions, **kwargs):
    raise RuntimeError("boom")

def short(completions, **kwargs):
    return [0.0]

for reward in (text, raising, short):
    args = rloo_jax.GRPOConfig(output_dir={str(tmp_path)!r} + "/" + reward.__name__, max_steps=2,
                               compilation_cache=False, per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=6, report_to="none")
    trainer = rloo_jax.GRPOTrainer("demo", reward, args=args, train_dataset=demo.make_rows(16, seed=0))
    try:
        trainer.train()
    except RewardError as e:
        print("caught:", e)
        print("threads:", [t.name for t in threading.enumerate() if t is not threading.main_thread()])
print("alive")
''')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**env, "JAX_PLATFORMS": "cpu", "RLOO_JAX_CACHE": str(tmp_path / "cache")})
    caught = [line for line in done.stdout.splitlines() if line.startswith("caught: ")]
    assert [c.split(" ")[1:4] for c in caught] == [["reward", "function", "'text'"], ["reward", "function",
                                                   "'raising'"], ["reward", "function", "'short'"]], done.stdout
    assert [line for line in done.stdout.splitlines() if line.startswith("threads:")] == ["threads: []"] * 3
    assert done.returncode == 0 and done.stdout.rstrip().endswith("alive"), (done.returncode, done.stderr[-3000:])
