"""Outputs on cloud storage: `rloo_jax.outputs` on gs:// paths of a local GCS fake (tests/gcs.py), and a training
run on gs:// killed with SIGKILL and resumed, equal to the same run on a local disk."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rloo_jax import outputs
from rloo_jax.export import main as export_main
from rloo_jax.metrics import JsonlWriter, drop_records_after, read_jsonl
from tests.gcs import BUCKET, gcs  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URL = f"gs://{BUCKET}"


def test_paths_local_and_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert outputs.is_remote("gs://b/run") and outputs.is_remote("s3://b/x") and not outputs.is_remote("run")
    assert not outputs.is_remote("file:///tmp/x") and not outputs.is_remote("~/x")
    assert outputs.join("gs://b/run", "checkpoints") == "gs://b/run/checkpoints"
    assert outputs.join("run", "metrics.jsonl") == str(tmp_path / "run" / "metrics.jsonl")
    assert outputs.join("file:///tmp/x", "a") == "/tmp/x/a"


def test_jsonl_on_gcs_is_staged_and_uploaded_whole(gcs):  # noqa: F811
    path = f"{URL}/unit/metrics.jsonl"
    w = JsonlWriter(path)  # SYNC_SECONDS 60: nothing is uploaded between syncs in this test
    w.write({"step": 1, "x": 1.0})
    assert not outputs.exists(path)
    w.sync()
    assert read_jsonl(path) == [{"step": 1, "x": 1.0}]
    w.write([{"step": 2}, {"step": 3}])
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    again = outputs.AppendFile(path, sync_seconds=0.0)  # a resumed run: starts from the remote content
    again.write('{"step": 4}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]  # sync_seconds 0: uploaded at the write
    again.close()


def test_drop_records_after_on_gcs(gcs):  # noqa: F811
    path = f"{URL}/unit/drop.jsonl"
    outputs.write_text(path, "".join(f'{{"step": {s}}}\n' for s in (1, 2, 3, 4)) + '{"step": 5, "torn')
    assert drop_records_after(path, 2) == 3  # steps 3 and 4, and the torn last line
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert drop_records_after(f"{URL}/unit/missing.jsonl", 2) == 0


# every character str.splitlines splits on, and \r\n; JSON escapes the ASCII ones, not U+0085, U+2028, U+2029
SEPARATORS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def test_splitlines_splits_on_exactly_these_characters():
    """The list above is complete: str.splitlines splits on these and on no other character (all of Unicode)."""
    splitters = {chr(c) for c in range(0x110000) if 0xD800 > c or c > 0xDFFF if len(f"a{chr(c)}b".splitlines()) == 2}
    assert splitters == {s for s in SEPARATORS if len(s) == 1}


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_jsonl_records_keep_every_line_separator(where, tmp_path, request):
    """Records whose text (values and keys) holds each separator are written as one line each, read back equal,
    and survive drop_records_after; a file written with those characters raw (before `jsonl_line` escaped the
    non-ASCII ones) reads back whole as well."""
    base = f"{URL}/unit/sep" if where == "gcs" else str(tmp_path)
    if where == "gcs":
        request.getfixturevalue("gcs")
    text = "x".join(SEPARATORS)
    records = [{"step": s, "prompt": f"{sep}p{s}", "completion": text, f"k{sep}": [sep, {"in": sep}]}
               for s in (1, 2) for sep in SEPARATORS]
    path = f"{base}/rollouts.jsonl"
    w = JsonlWriter(path)
    w.write(records)
    w.close()
    raw = outputs.read_text(path)
    assert raw.count("\n") == len(records) and not set(raw) & {s for s in SEPARATORS if s != "\n"}
    assert read_jsonl(path) == records
    assert drop_records_after(path, 1) == len(SEPARATORS) and read_jsonl(path) == records[: len(SEPARATORS)]
    # the raw characters (json.dumps ensure_ascii=False writes U+0085, U+2028, U+2029 as they are)
    legacy = f"{base}/legacy.jsonl"
    outputs.write_text(legacy, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    assert "\u2028" in outputs.read_text(legacy) and read_jsonl(legacy) == records
    assert drop_records_after(legacy, 1) == len(SEPARATORS) and read_jsonl(legacy) == records[: len(SEPARATORS)]


def test_rollout_records_carry_token_ids_and_log_probs():
    """Ids and every series cut to the EOS-cut length; float32 values exactly; a completion the loss masked whole
    (truncated, mask_truncated_completions) has no log-probs; `logprob_series` names who computed what."""
    import numpy as np

    from rloo_jax.metrics import TokenRecords, logprob_series, rollout_records

    ids = np.array([[5, 6, 1, 0], [7, 8, 9, 9]])
    mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0]])
    sampler = np.array([[-0.1, -0.2, -0.3, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    ref = np.float32(1 / 3) * sampler
    series = logprob_series(sampler, ref, None)
    assert list(series) == ["sampler", "reference"] and series["sampler"] is sampler
    assert list(logprob_series(sampler, None, ref)) == ["sampler", "trainer"]  # recomputed: old is the trainer's
    assert logprob_series(sampler, None, ref)["sampler"] is ref
    records = rollout_records(3, ["p", "p"], ["ab", "cdee"], ["f"], np.zeros((2, 1)), np.zeros(2), np.zeros(2),
                              np.array([3, 4]), np.array([False, True]), tokens=TokenRecords(ids, mask, series))
    assert records[0]["completion_ids"] == [5, 6, 1] and records[1]["completion_ids"] == [7, 8, 9, 9]
    assert records[0]["logprobs"] == {"sampler": [-0.1, -0.2, -0.3],
                                      "reference": [-0.033333335, -0.06666667, -0.10000001]}
    assert [np.float32(x) for x in records[0]["logprobs"]["reference"]] == list(ref[0, :3])  # float32-exact
    assert records[1]["logprobs"] is None
    assert "completion_ids" not in rollout_records(3, ["p"], ["ab"], ["f"], np.zeros((1, 1)), np.zeros(1),
                                                   np.zeros(1), np.array([2]), np.array([False]))[0]


def test_staged_dir_uploads_new_and_grown_files_only(gcs, monkeypatch):  # noqa: F811
    uploads = []
    upload = outputs.upload_file
    monkeypatch.setattr(outputs, "upload_file", lambda a, b: uploads.append(b) or upload(a, b))
    d = outputs.StagedDir(f"{URL}/unit/tb")
    open(os.path.join(d.local, "events.1"), "w").write("a")
    d.sync()
    os.makedirs(os.path.join(d.local, "sub"))
    open(os.path.join(d.local, "sub", "events.2"), "w").write("b")
    d.sync()
    assert uploads == [f"{URL}/unit/tb/events.1", f"{URL}/unit/tb/sub/events.2"]  # events.1 unchanged: once
    with open(os.path.join(d.local, "events.1"), "a") as f:
        f.write("c")
    d.close()
    assert outputs.read_text(f"{URL}/unit/tb/events.1") == "ac" and not os.path.exists(d.local)


def test_staged_dir_uploads_on_success_only(gcs):  # noqa: F811
    with outputs.staged_dir(f"{URL}/unit/export") as local:
        (local / "config.json").write_text("{}")
    assert outputs.read_text(f"{URL}/unit/export/config.json") == "{}"
    with pytest.raises(RuntimeError), outputs.staged_dir(f"{URL}/unit/failed") as local:
        (local / "config.json").write_text("{}")
        raise RuntimeError("export failed")
    assert not outputs.exists(f"{URL}/unit/failed/config.json")


def test_compile_report_and_config_on_gcs(gcs):  # noqa: F811
    import json

    from rloo_jax.aot import Report
    from rloo_jax.cli import load_config
    from rloo_jax.tpu import parse_slice

    path = Report(parse_slice("v5e-8"), [], {"model": "m"}).write(f"{URL}/unit/compile")
    assert path == f"{URL}/unit/compile/compile_report.json"
    assert json.loads(outputs.read_text(path))["topology"] == "v5e-8"
    cfg = load_config(["--model_name_or_path", "demo", "--dataset_name", "demo", "--reward_funcs", "format",
                       "--output_dir", f"{URL}/unit/cfg"])
    outputs.write_text(outputs.join(cfg.output_dir, "config.yaml"), cfg.to_yaml())
    assert outputs.read_text(f"{URL}/unit/cfg/config.yaml") == cfg.to_yaml()


# ------------------------------------------------------------------------------------------------ a run on gs://
# 8 steps, a checkpoint every 4; every completion recorded; 0.3 s of reward per step, so the kill lands mid-run
RUN = [
    "--max_steps", "8", "--save_steps", "4", "--logging_steps", "1", "--log_completions", "true",
    "--reward_funcs", "tests.gcs:paced_letters_reward", "--per_device_train_batch_size", "16",
    "--num_generations", "4", "--max_completion_length", "6", "--max_prompt_length", "5", "--eval_steps", "None",
]  # fmt: skip
WALL_TIME = {"step_time"}


def launch(out, env, cache, log):
    """`python -m rloo_jax.train RUN --output_dir out` (logs to files: no pipe can stall it)."""
    args = [sys.executable, "-m", "rloo_jax.train", *RUN, "--output_dir", str(out), "--compilation_cache_dir",
            str(cache)]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(f"{log}.out", "w"), stderr=open(f"{log}.err", "w"))


def finished(proc, log, timeout=240):
    rc = proc.wait(timeout=timeout)
    return rc, open(f"{log}.out").read(), open(f"{log}.err").read()


def without_wall_time(records):
    return [{k: v for k, v in r.items() if k not in WALL_TIME and not k.startswith("timing/")} for r in records]


@pytest.mark.slow
def test_run_on_gcs_killed_and_resumed_equals_a_local_run(gcs, tmp_path):  # noqa: F811
    env = dict(os.environ, **gcs, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", RLOO_JAX_SYNC_SECONDS="0")
    cache, local, remote = tmp_path / "cache", tmp_path / "local", f"{URL}/run"
    rc, _, err = finished(launch(local, env, cache, tmp_path / "local"), tmp_path / "local")
    assert rc == 0, err[-3000:]

    # SIGKILL once checkpoint 4 is complete on the bucket and a later step is logged there (RLOO_JAX_SYNC_SECONDS
    # 0: every record is uploaded as written), so the resume must drop records after its checkpoint
    proc = launch(remote, env, cache, tmp_path / "killed")
    deadline = time.monotonic() + 240
    try:
        while not (outputs.exists(f"{remote}/checkpoints/4/commit_success.txt") and outputs.exists(
                f"{remote}/metrics.jsonl") and max(r["step"] for r in read_jsonl(f"{remote}/metrics.jsonl")) >= 5):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its kill point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        rc, _, err = finished(proc, tmp_path / "killed")
    assert rc == -signal.SIGKILL, err[-3000:]
    logged = [r["step"] for r in read_jsonl(f"{remote}/metrics.jsonl")]
    assert 5 <= max(logged) < 8, logged

    rc, out, err = finished(launch(remote, env, cache, tmp_path / "resumed"), tmp_path / "resumed")
    assert rc == 0, err[-3000:]
    assert f"Resuming from checkpoint {remote}/checkpoints/4 (step 4; dropped" in out  # records of steps 5..
    assert f"Outputs in {remote}:" in out
    # the same metrics, completions and final weights as the uninterrupted local run
    got, want = read_jsonl(f"{remote}/metrics.jsonl"), read_jsonl(local / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 9))
    assert without_wall_time(got) == without_wall_time(want)
    assert read_jsonl(f"{remote}/rollouts.jsonl") == read_jsonl(local / "rollouts.jsonl")
    assert len(read_jsonl(local / "rollouts.jsonl")) == 8 * 16
    final = outputs.resolve(f"{remote}/final/model.safetensors").read_bytes()
    assert final == (local / "final" / "model.safetensors").read_bytes()
    assert "output_dir: gs://" in outputs.read_text(f"{remote}/config.yaml")

    # the export command reads a checkpoint on the bucket and writes to the bucket: what it writes for the local run
    assert export_main([f"{remote}/checkpoints/4", f"{URL}/export4", "--dtype", "bfloat16"]) == 0
    assert export_main([str(local / "checkpoints" / "4"), str(tmp_path / "export4"), "--dtype", "bfloat16"]) == 0
    exported = outputs.resolve(f"{URL}/export4/model.safetensors").read_bytes()
    assert exported == (tmp_path / "export4" / "model.safetensors").read_bytes()
    assert outputs.read_text(f"{URL}/export4/config.json") == (tmp_path / "export4" / "config.json").read_text()
