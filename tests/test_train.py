"""The training script end to end (``models.train.main``, the ``python -m models.train`` entry
point) with tiny settings: loss falls (also in ZeRO mode); a resumed run reproduces an
uninterrupted one exactly, also past a corrupt latest checkpoint or a torn metrics line;
every flag and policy entry is checked before any work starts."""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import mp_train_worker
import numpy as np
import pytest

import jcoccl
from models import checkpoint, train
from models.configs.models import TINY_RUN

TINY = [
  *TINY_RUN,
  "--warmup",
  "5",
  "--eval-batches",
  "2",
  "--no-progress",
]


def _restore(out, step):
  import orbax.checkpoint as ocp

  mngr = checkpoint.checkpointer(out)
  try:
    assert step in mngr.all_steps()
    return mngr.restore(step, args=ocp.args.StandardRestore())
  finally:
    mngr.close()


@pytest.mark.slow
def test_loss_drops_and_outputs_written(tmp_path, capsys):
  out = tmp_path / "run"
  summary = train.main(TINY + ["--steps", "40", "--eval-every", "20", "--out", str(out)])
  assert summary["loss_end"] < summary["loss_start"] - 0.8, summary
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  vals = [r["val_loss"] for r in recs if "val_loss" in r]
  assert len(vals) == 2 and vals[1] < vals[0]
  assert (out / "loss.png").stat().st_size > 1000
  assert json.loads((out / "calibration.json").read_text()) == {
    "calibrated": False,
    "why": "--no-calibrate",
  }
  # Warmup starts at lr/warmup, so the first optimizer step already moves the weights.
  first = next(r for r in recs if "loss" in r)
  assert first["step"] == 1 and first["lr"] == pytest.approx(1e-2 / 5)
  wire = summary["wire"]
  assert wire["source"].startswith("measured: jcoccl.wire_bytes")
  assert set(wire["by_axis"]) == {"data", "tensor", "pipe"}
  assert all(0 < r["compressed"] < r["uncompressed"] for r in wire["by_axis"].values())
  assert wire["total"]["compressed"] == pytest.approx(
    sum(r["compressed"] for r in wire["by_axis"].values())
  )
  assert [r["wire"] for r in recs if "wire" in r] == [wire]
  # The exact twin trained alongside on the same batches: what compression cost.
  twin = summary["exact_twin"]
  assert twin["val_loss_end"] == next(
    r["exact_val_loss"] for r in reversed(recs) if "val_loss" in r
  )
  assert twin["loss_end"] < summary["loss_start"] - 0.8 and twin["tokens_per_s"] > 0
  assert all("exact_loss" in r for r in recs if "loss" in r)
  text = capsys.readouterr().out
  assert "tokens/s" in text and "by mesh axis (measured" in text
  assert "what compression cost in this run: " in text
  # The trained weights through exact collectives, beside the loss through the run's own.
  through = summary["val_loss_exact_collectives"]
  assert through != summary["val_loss_end"] and abs(through / summary["val_loss_end"] - 1) < 0.05
  assert f"val loss of the trained weights through exact collectives: {through:.4f}" in text


@pytest.fixture
def no_cost_model():
  """Each train.main call starts without a cost model, as a new process does (a run
  installs its calibration as the process default)."""
  jcoccl.set_cost_model(None)
  yield
  jcoccl.set_cost_model(None)


WORKER = pathlib.Path(__file__).with_name("mp_train_worker.py")


def _stopped_by_signal(argv: list[str], sig: int, before: int, env: dict) -> str:
  """Runs ``models.train`` with ``argv`` in a subprocess (mp_train_worker: it prints
  ``batch <step>`` before each step and sleeps 2 s before each from step ``before`` on),
  sends ``sig`` once it has printed ``batch <before>``, i.e. while it is training, and
  returns its output after it ended with status 128 + ``sig``."""
  p = subprocess.Popen(
    [sys.executable, str(WORKER), str(before), "2", *argv],
    cwd=WORKER.parents[1],
    env={**os.environ, **env},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  lines = []
  try:
    assert p.stdout is not None
    for line in p.stdout:
      lines.append(line)
      if line.strip() == f"batch {before}":
        p.send_signal(sig)
        break
    rest, _ = p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  text = "".join(lines) + rest
  assert p.returncode == 128 + sig, text[-3000:]
  return text


def _signal_in_process(monkeypatch, capfd, argv: list[str], sig: int, before: int) -> str:
  """Runs ``train.main(argv)`` in this process, which sends itself ``sig`` as it draws the
  batch of step ``before``; returns what the run printed after it ended in a SystemExit of
  128 + ``sig``."""
  from models import loop

  batch_at = loop.batch_at

  def signalling(corpus, cfg, par, split, step, i=0):
    if split == "train" and step == before:
      os.kill(os.getpid(), sig)
    return batch_at(corpus, cfg, par, split, step, i)

  monkeypatch.setattr(loop, "batch_at", signalling)
  capfd.readouterr()
  with pytest.raises(SystemExit) as e:
    train.main(argv)
  monkeypatch.setattr(loop, "batch_at", batch_at)
  assert e.value.code == 128 + sig
  got = capfd.readouterr()  # the handler's notice goes straight to file descriptor 2
  return got.out + got.err


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["coccl", "coccl --zero"])
def test_resume_reproduces_uninterrupted_run(tmp_path, monkeypatch, capfd, no_cost_model, policy):
  """A run stopped by a signal, then resumed, ends bitwise where the uninterrupted run ends.
  The copy is run b, sent SIGINT (coccl: a subprocess, which must exit with status 130 and
  no traceback) or SIGTERM (ZeRO: this process signals itself, and the run ends in a
  SystemExit of 143; tests/test_train_multiprocess.py sends SIGTERM to a subprocess) while
  it waits to run step ``at``: it finishes that step, saves a checkpoint of it (b saves no
  other) and says so in one line with the resume command. The
  coccl case runs with the start-up calibration and an "auto:<spec>" data all_reduce: a stand-in
  calibrate makes compression win the first time and the exact op any later time, so a
  resumed run that measured again (as before calibrations were saved) would send 'data'
  exactly and end elsewhere; it must reuse the checkpoint's calibration instead. The ZeRO
  case's uninterrupted run (20 steps) is also the check that ZeRO training learns: int4
  reduce_scatter with error feedback, AdamW state sharded over 'data'. (The resume of an
  exact policy with stochastic tensor activations is compared bitwise in
  test_resume_falls_back_past_a_corrupt_checkpoint_and_a_torn_metrics_line.)"""
  calibrated, zero = policy == "coccl", "--zero" in policy
  steps, at = (20, 10) if zero else (6, 3)
  common = TINY + [
    "--policy",
    *policy.split(),
    "--mesh",
    "2,1,2",
    "--ckpt-every",
    str(at),
    "--eval-every",
    "100",
    "--no-exact-twin",  # a resumed run trains none: the run itself is compared
    "--steps",
    str(steps),
  ]
  if calibrated:
    common = [a for a in common if a != "--no-calibrate"]
    common += ["--compress", "data.all_reduce=auto:hadamard(int4)"]
    fake = mp_train_worker.fake_calibrate(["compress", "exact"])
    monkeypatch.setattr(jcoccl, "calibrate", fake)
  a, b = tmp_path / "a", tmp_path / "b"
  # The ZeRO run measures its wire bytes (an extra compile of the exact step).
  sa = train.main(common + ([] if zero else ["--no-hlo-wire"]) + ["--out", str(a)])
  sig = signal.SIGTERM if zero else signal.SIGINT
  # The worker's calibration is the stand-in's first table (mp_train_worker.crafted).
  env = {"JCOCCL_TEST_CALIBRATION": "compress"} if calibrated else {}
  env["JCOCCL_TEST_REPORT_MODULES"] = "1"
  argv = common + ["--no-hlo-wire", "--out", str(b), "--ckpt-every", "100"]
  if zero:
    text = _signal_in_process(monkeypatch, capfd, argv, sig, at - 1)
  else:
    text = _stopped_by_signal(argv, sig, at - 1, env)
  name = signal.Signals(sig).name
  assert f"models.train: {name}: saving a checkpoint after the current step" in text, text
  # At step `at`, or the next one where the signal came late on a loaded machine.
  found = re.search(
    rf"^models\.train: stopped by {name} at step (\d+) of {steps}; checkpoint saved in "
    rf"{re.escape(str(b / 'ckpt'))}; resume with: python -m models\.train .* --ckpt-every "
    r"100 --resume$",
    text,
    re.M,
  )
  assert found and "Traceback" not in text, text
  if not zero:  # the training path (start, calibration, steps, the stop) never loads the probe
    assert "modules error_probe=False" in text, text[-3000:]
  stop = int(found.group(1))
  assert stop in (at, at + 1) and train.checkpoint_steps(b) == [stop]
  jcoccl.set_cost_model(None)
  summary = train.main(common + ["--no-hlo-wire", "--out", str(b), "--resume"])
  assert summary["resumed_from"] == stop and summary["steps"] == steps
  assert summary["wire"]["source"] is None and "--no-hlo-wire" in summary["wire"]["note"]
  ta, tb = _restore(a, steps), _restore(b, steps)
  assert int(tb["step"]) == steps
  leaves_a, leaves_b = jax.tree.leaves(ta), jax.tree.leaves(tb)
  assert len(leaves_a) == len(leaves_b) > 10
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  recorded = [json.loads(l)["step"] for l in (b / "metrics.jsonl").read_text().splitlines()]
  assert recorded == sorted(recorded) and recorded[-1] == steps
  ca, cb = (json.loads((d / "calibration.json").read_text()) for d in (a, b))
  assert cb.pop("reused_from_step", stop) == stop and ca == cb
  assert summary["auto"] == sa["auto"]
  if calibrated:
    assert fake.calls == ["compress"]  # run a measured; the resumed run did not
    assert ca["cost_model"]["source"] == "test: compress wins"
    assert sa["auto"]["data"]["auto_exact_keeps"] == 0 and sa["auto"]["data"]["opted_in"]
  if zero:
    assert sa["loss_end"] < sa["loss_start"] - 0.5, sa
    wire = sa["wire"]["by_axis"]["data"]
    assert 0 < wire["compressed"] < wire["uncompressed"], wire
    # The checkpoint holds the float32 master weights and the AdamW moments as flat shards
    # over 'data'.
    opt = ta["opt_state"]
    for t in (opt["master"], opt["tx"][0]["mu"]):
      assert all(x.ndim == 1 and "data" in x.sharding.spec[0] for x in jax.tree.leaves(t))


def test_a_second_signal_ends_the_process_at_once(monkeypatch):
  """The first SIGINT/SIGTERM asks the loop to stop after its step (test_resume_reproduces_
  uninterrupted_run); a second ends the process there and then (os._exit, stubbed here),
  with 128 + that signal. Leaving the steps restores the handlers that were there."""
  from models import interrupt

  ended = []
  monkeypatch.setattr(interrupt.os, "_exit", ended.append)
  before, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with interrupt.Stop() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signum == stop.agreed() == signal.SIGINT and ended == []
    os.kill(os.getpid(), signal.SIGTERM)
    assert ended == [143]
  # (SIG_IGN where pytest runs in a background job: the shell ignores SIGINT there.)
  assert signal.getsignal(signal.SIGINT) == before_int
  assert signal.getsignal(signal.SIGTERM) == before
  assert interrupt.resume_command(["--steps", "9", "--out", "a b"]) == (
    "python -m models.train --steps 9 --out 'a b' --resume"
  )


def test_the_policy_header_keeps_auto_and_the_bar_stays_off_a_log(tmp_path):
  """The run's policy header writes an "auto:<spec>" entry as the file does (it may run the
  exact op; a plain spec always compresses). The progress bar is drawn only on a terminal:
  a log file would hold each of its redraws (here stderr is pytest's capture)."""
  from models import loop
  from models.recipe import Recipe

  lean = Recipe.from_toml(str(train.CONFIGS / "lean.toml")).describe().splitlines()
  assert lean[0] == "data: all_reduce=auto:hadamard(int4) error_feedback min_bytes=0"
  assert lean[1].startswith("pipe: ppermute=hadamard(int4) all_reduce=auto:hadamard(int4)")
  args = train.parse_args(TINY + ["--out", str(tmp_path / "run")])
  cfg = train.RunConfig.from_args(args)
  assert loop._progress_bar(dataclasses.replace(cfg, no_progress=False), 0).disable


def test_calibration_modes_and_verdict():
  """--resume reuses the saved calibration unless --recalibrate or --no-calibrate; the
  verdict compares the exact op with compression per axis under the run's table and says
  how to let auto decide where the policy named the codec."""
  from jcoccl import compressors as jc
  from models import calibration, parallel

  mode = calibration.mode
  assert [mode(True, False, False), mode(True, True, False), mode(True, True, True)] == [
    "measure",
    "reuse",
    "remeasure",
  ]
  assert mode(False, True, False) == "off"
  mesh = parallel.make_mesh(2, 1, 2)
  record = {"calibrated": True, "cost_model": mp_train_worker.crafted("exact", mesh).to_json()}
  policy = jcoccl.Policy.from_dict(
    {"data": {"all_reduce": "int8"}, "pipe": {"all_reduce": "auto:int8"}}
  )
  from jcoccl._src.observability.explain import Record

  # jcoccl.explain's records of a step: two int8 'data' leaves named by the policy, a 'pipe'
  # leaf whose auto kept the exact op, an exact scalar sum and a ppermute (both ignored).
  row = lambda axis, op, shape, named: Record("jcoccl", op, (axis,), shape, "float32", named=named)
  log = [row("data", "all_reduce", (256,), "int8")] * 2
  log += [row("pipe", "all_reduce", (4096,), "auto:int8"), row("data", "all_reduce", (), "none")]
  log += [row("data", "ppermute", (8,), "int8"), Record("lax", "all_reduce", ("data",), (8,))]
  f32 = np.dtype(np.float32)
  assert calibration.compressed_all_reduces(log) == [("data", (256,), f32, jc.int8())] * 2 + [
    ("pipe", (4096,), f32, jc.int8())
  ]
  v = calibration.verdict(record, log, policy, mesh)
  assert set(v) == {"data", "pipe"}
  assert v["data"]["messages"] == 2 and v["data"]["bytes"] == [1024, 1024]
  assert v["data"]["auto_exact_keeps"] == 2 and not v["data"]["opted_in"]
  assert v["pipe"]["opted_in"] and v["pipe"]["exact_s"] < v["pipe"]["compressed_s"]
  text = "\n".join(calibration.verdict_lines(v, record))
  # Per axis, what the run did: 'data' names its codec, 'pipe' opted in to auto.
  assert re.search(
    r"data   all_reduce int8, 2 arrays of 1.0 KiB: compressed all 2, as the policy names "
    r"the codec; 'auto:int8' would keep the exact op for all 2: calibration predicted the "
    r"exact op over 1000x faster \(exact",
    text,
  ), text
  assert re.search(
    r"pipe   all_reduce auto:int8, 1 arrays of 16 KiB: kept the exact op for all 1: "
    r"calibration predicted the exact op over 1000x faster",
    text,
  ), text
  assert "compresses on data although" in text and "--compress data.all_reduce=auto:int8" in text
  none = {"calibrated": False, "why": "--no-calibrate"}
  assert calibration.verdict(none, log, policy, mesh) == {}
  assert "(--no-calibrate)" in calibration.verdict_lines({}, none)[0]


# ---- flags and policies are checked before any work -------------------------------------

# (argv, what the error must say): every flag with a value outside its range, of the wrong
# type, or that does not fit the mesh or the model.
BAD_FLAGS = [
  (["--steps", "-1"], "--steps must be >= 0"),
  (["--steps", "x"], "argument --steps: invalid int"),
  (["--seq-len", "0"], "--seq-len must be >= 1"),
  (["--batch", "0"], "--batch must be >= 1"),
  (["--batch", "3"], "--batch 3 must be a multiple of the data size 2 .* --micro 2 = 4"),
  (["--batch", "6", "--mesh", "2,1,1", "--micro", "2"], "--batch 6 must be a multiple"),
  (["--batch", "8", "--mesh", "4,2,1", "--micro", "4"], "--batch 8 must be a multiple"),
  (["--micro", "0"], "--micro must be >= 1"),
  (["--eval-every", "0"], "--eval-every must be >= 1"),
  (["--eval-batches", "0"], "--eval-batches must be >= 1"),
  (["--ckpt-every", "0"], "--ckpt-every must be >= 1"),
  (["--log-every", "0"], "--log-every must be >= 1"),
  (["--sample-tokens", "-1"], "--sample-tokens must be >= 0"),
  (["--warmup", "-1"], "--warmup must be >= 0"),
  (["--seed", "-1"], "--seed must be >= 0"),
  (["--seed", str(2**32)], "--seed must be < 2..32"),
  (["--max-chars", "0"], "--max-chars must be >= 1"),
  (["--lr", "0"], "--lr must be a finite number > 0"),
  (["--lr", "nan"], "--lr must be a finite number > 0"),
  (["--lr=-1e-3"], "--lr must be a finite number > 0"),
  (["--weight-decay=-0.1"], "--weight-decay must be a finite number >= 0"),
  (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0"),
  (["--clip", "0"], "--clip must be a finite number > 0"),
  (["--clip", "inf"], "--clip must be a finite number > 0"),
  (["--mesh", "2,2"], "--mesh must be three positive integers"),
  (["--mesh", "2,2,x"], "--mesh must be three positive integers"),
  (["--mesh", "0,2,2"], "--mesh must be three positive integers"),
  (["--mesh", "2,2,4"], "--mesh 2,2,4 needs 16 devices; 8 are available"),
  (["--mesh", "1,1,3"], "--mesh 1,1,3: the pipe size 3 must divide the 4 layers"),
  (["--mesh", "1,8,1"], "--mesh 1,8,1: the tensor size 8 must divide the head counts"),
  (
    ["--model", "qwen", "--mesh", "1,4,1", "--batch", "4"],
    "--mesh 1,4,1: the tensor size 4 must divide",
  ),
  (["--zero", "--mesh", "1,2,2"], "--zero shards over the data axis, which needs a size > 1"),
  (["--name", ""], "--name must be a non-empty name"),
  (["--name", "a/b"], "--name must be a non-empty name without '/'"),
  (["--policy", "nope"], "--policy must be a TOML file or one of"),
  (["--compress", "model.all_reduce=int8"], "--compress 'model.all_reduce=int8': .*unknown axis"),
  (["--compress", "data.all_reduce=int8:"], "--compress 'data.all_reduce=int8:': .*cannot parse"),
  (
    ["--compress", "data.all_reduce=fp9"],
    "--compress .*unknown compressor 'fp9' \\(did you mean 'fp8'",
  ),
  (["--compress", "data.all_reduce=int8:sym,asym"], "--compress .*at most once"),
  (["--compress", "data.broadcast=int8"], "--compress .*unknown key 'broadcast'"),
  (["--compress", "tensor.zero=true"], "--compress .*zero applies to the 'data' axis only"),
  (["--compress", "pipe.error_feedback=1"], "--compress .*error_feedback applies to the 'data'"),
  (["--compress", "data.algorithm=ring"], "--compress .*algorithm must be one of"),
  (["--compress", "data.min_bytes=-1"], "--compress .*non-negative integer"),
  (["--compress", "data=int8"], "--compress 'data=int8': .*axis.op=spec"),
]


def _parse_error(argv, capsys) -> str:
  with pytest.raises(SystemExit) as e:
    train.parse_args(argv)
  assert e.value.code == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("argv,match", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_an_argparse_error(tmp_path, capsys, argv, match):
  err = _parse_error(argv + ["--out", str(tmp_path / "run")], capsys)
  assert re.search(f"error: {match}", err), err


def test_defaults_and_tiny_flags_parse(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("JCOCCL_RUNS_DIR")  # conftest points it away from any runs/
  args = train.parse_args([])
  assert args.mesh_shape == (2, 2, 2) and args.out == pathlib.Path("runs/gpt-small")
  monkeypatch.setenv("JCOCCL_RUNS_DIR", str(tmp_path / "elsewhere"))
  assert train.parse_args([]).out == tmp_path / "elsewhere" / "gpt-small"
  args = train.parse_args(
    TINY
    + [
      "--steps",
      "0",
      "--mesh",
      "1,1,1",
      "--batch",
      "2",
      "--micro",
      "1",
      "--model",
      "qwen",
      "--compress",
      "data.zero=true",
      "--compress",
      "*.ppermute=fp8:e5m2",
    ]
  )
  assert args.policy_path.name == "coccl.toml"


def test_resume_and_fresh_runs_check_the_output_dir(tmp_path, capsys):
  out = tmp_path / "run"
  err = _parse_error(["--resume", "--out", str(out)], capsys)
  assert f"error: --resume: no checkpoint under {out / 'ckpt'}" in err
  (out / "ckpt" / "3").mkdir(parents=True)
  err = _parse_error(["--out", str(out)], capsys)
  assert "holds checkpoints of an earlier run (steps 3): pass --resume" in err
  assert train.parse_args(["--out", str(out), "--resume"]).resume
  # A bad flag is reported first, whatever the output directory holds.
  err = _parse_error(["--out", str(out), "--codec", "no_such_module_x"], capsys)
  assert "error: --codec: cannot import codec module 'no_such_module_x'" in err
  (tmp_path / "file").write_text("")
  assert "is a file" in _parse_error(["--out", str(tmp_path / "file")], capsys)
  # Checked before any work, not found as a traceback at the first file written.
  err = _parse_error(["--out", str(tmp_path / "file" / "run")], capsys)
  assert f"error: --out {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file" in err
  if os.geteuid() == 0:  # root writes anywhere a mode allows: sysfs refuses even root
    locked = pathlib.Path("/sys/jcoccl-test")
  else:
    (tmp_path / "ro").mkdir(mode=0o500)
    locked = tmp_path / "ro" / "run"
  err = _parse_error(["--out", str(locked)], capsys)
  assert re.search(rf"error: --out {re.escape(str(locked))}: cannot write there \(\w", err), err


BAD_TOML = [
  ('[model]\nall_reduce = "int8"\n', r"\[model\]: unknown axis 'model'"),
  ("[tensor]\nzero = true\n", r"\[tensor\] zero: zero applies to the 'data' axis only"),
  ('[data]\nalgorithm = "ring"\n', r"\[data\] algorithm must be one of"),
  ('[data]\nall_reduce = "int8:sym,asym"\n', r"\[data\] all_reduce: cannot parse"),
  ('[data]\nall_reduce = "int8:"\n', r"\[data\] all_reduce: cannot parse"),
  ("[data]\nmin_bytes = -1\n", r"\[data\] min_bytes must be a non-negative int"),
  ('[data]\nzero = "yes"\n', r"\[data\] zero must be a bool"),
  ('[pipe]\npermute = "int8"\n', r"\[pipe\] has unknown key 'permute'"),
  ("[pipe\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,match", BAD_TOML)
def test_bad_policy_file_fails_before_any_work(tmp_path, monkeypatch, text, match):
  f = tmp_path / "bad.toml"
  f.write_text(text)

  def no_work(*a, **k):
    raise AssertionError("the corpus was loaded before the policy was checked")

  monkeypatch.setattr(train.data, "load_corpus", no_work)
  with pytest.raises(ValueError, match=f"bad.toml: {match}") as e:
    train.main(TINY + ["--policy", str(f), "--out", str(tmp_path / "run")])
  assert isinstance(e.value, train.SetupError)


def test_compress_override_keeps_the_wildcard_entries(tmp_path):
  """--compress data.all_reduce=int4 over a policy that sets only '*' changes that op only:
  'data' keeps the '*' ppermute compressor and min_bytes = 0."""
  import jcoccl.compressors as jc

  args = train.parse_args(
    TINY
    + [
      "--policy",
      "int8",
      "--compress",
      "data.all_reduce=int4",
      "--zero",
      "--out",
      str(tmp_path / "run"),
    ]
  )
  recipe = train.load_policy(args)
  policy = recipe.policy
  assert policy.compressor("data", "all_reduce") == jc.int4()
  assert policy.compressor("data", "ppermute") == jc.int8()
  assert policy.options("data")["min_bytes"] == 0 and recipe.zero
  assert policy.compressor("tensor", "all_reduce") == jc.int8()


def _cli(*argv):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = pathlib.Path(train.__file__).parents[1]
  return subprocess.run(
    [sys.executable, "-m", "models.train", *argv],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
    cwd=root,
  )


def test_cli_errors_exit_2_without_traceback(tmp_path):
  r = _cli("--batch", "3", "--out", str(tmp_path / "a"))
  assert r.returncode == 2 and "error: --batch 3 must be a multiple" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr


def test_cli_reports_a_setup_error_like_a_bad_flag(tmp_path, capsys):
  """A policy file's error is found by train.main (after the flags parse): train.cli, what
  ``python -m models.train`` exits with, reports it as argparse does (in this process: the
  process exit itself is test_cli_errors_exit_2_without_traceback's)."""
  f = tmp_path / "bad.toml"
  f.write_text("[tensor]\nzero = true\n")
  assert train.cli(["--policy", str(f), "--out", str(tmp_path / "b")]) == 2
  err = capsys.readouterr().err
  assert f"python -m models.train: error: {f}: [tensor] zero: zero applies" in err
  assert "Traceback" not in err


def test_corpus_too_short_for_seq_len(tmp_path):
  with pytest.raises(train.SetupError, match="--seq-len 64 needs at least 66 tokens in the val"):
    train.main(TINY + ["--seq-len", "64", "--max-chars", "500", "--out", str(tmp_path)])


def test_corpus_batch_needs_seq_len_plus_two_tokens():
  from models import data

  corpus = data.Corpus(np.arange(10), np.arange(5), 10, "char")
  rng = np.random.default_rng(0)
  assert corpus.batch(rng, "val", batch=2, seq_len=3)[0].shape == (2, 3)
  for seq_len in (4, 5):  # 5 tokens hold one window of 4 + 1, but no start to draw
    with pytest.raises(ValueError, match=f"seq_len {seq_len} needs at least {seq_len + 2}"):
      corpus.batch(rng, "val", batch=2, seq_len=seq_len)
  with pytest.raises(ValueError, match="max_chars"):
    data.load_corpus("char", max_chars=0)


def test_zero_steps_finish_cleanly(tmp_path, capsys):
  out = tmp_path / "zero-steps"
  summary = train.main(
    TINY
    + [
      "--steps",
      "0",
      "--mesh",
      "1,1,1",
      "--batch",
      "2",
      "--micro",
      "1",
      "--no-hlo-wire",
      "--out",
      str(out),
    ]
  )
  assert summary["steps"] == 0 and summary["loss_start"] is None
  assert summary["tokens_per_s"] is None
  assert json.loads((out / "summary.json").read_text()) == summary
  assert (out / "metrics.jsonl").read_text() == ""
  assert train.checkpoint_steps(out) == []
  assert "no steps run: at step 0, --steps 0" in capsys.readouterr().out


# ---- resume past damage ----------------------------------------------------------------

# The resume tests' run: its tensor-parallel activations round stochastically (keys of the
# seed, step, point and call: models.collectives), so each bitwise resume below is also the
# check that a stochastic run resumes bit-exact (and that such a direction trains at all:
# before the keys it failed to compile).
SMALL = TINY + [
  "--no-exact-twin",
  "--direction",
  "tensor.forward=int4:stochastic",
  "--mesh",
  "1,2,1",
  "--batch",
  "2",
  "--micro",
  "1",
  "--seq-len",
  "16",
  "--max-chars",
  "20000",
  "--eval-batches",
  "1",
  "--eval-every",
  "100",
  "--ckpt-every",
  "2",
  "--no-hlo-wire",
  "--policy",
  "exact",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A 4-step run with checkpoints at steps 2 and 4."""
  out = tmp_path_factory.mktemp("resume") / "done"
  summary = train.main(SMALL + ["--steps", "4", "--out", str(out)])
  assert train.checkpoint_steps(out) == [2, 4] and np.isfinite(summary["val_loss_end"])
  return out


def _truncate_largest_array_file(step_dir):
  files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
  f = max(files, key=lambda f: f.stat().st_size)
  f.write_bytes(f.read_bytes()[:100])


def _garbage_metadata(step_dir):
  (step_dir / "default" / "_METADATA").write_text("{not json")


def _assert_same_checkpoint(a, b, step):
  ta, tb = _restore(a, step), _restore(b, step)
  for x, y in zip(jax.tree.leaves(ta), jax.tree.leaves(tb), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize(
  "damage,reason",
  [(_truncate_largest_array_file, "Exception"), (_garbage_metadata, "JSONDecodeError")],
  ids=["truncated-array-file", "garbage-json"],
)
def test_resume_falls_back_past_a_corrupt_checkpoint_and_a_torn_metrics_line(
  tmp_path, capsys, finished_run, damage, reason
):
  run = tmp_path / "run"
  shutil.copytree(finished_run, run)
  damage(run / "ckpt" / "4")
  # Killed while writing the step-4 record: the metrics end in half a line.
  lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
  torn = json.dumps({"step": 4, "loss": 1.0})[:12]
  (run / "metrics.jsonl").write_text("".join(lines[:-1]) + torn)
  capsys.readouterr()
  summary = train.main(SMALL + ["--steps", "4", "--out", str(run), "--resume"])
  err = capsys.readouterr().err
  assert re.search(f"skipping the checkpoint at step 4: {reason}", err), err
  assert "dropping the torn last line" in err and repr(torn) in err
  assert summary["resumed_from"] == 2 and summary["steps"] == 4
  assert (run / "ckpt-skipped" / "4").is_dir() and train.checkpoint_steps(run) == [2, 4]
  _assert_same_checkpoint(finished_run, run, 4)
  recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == sorted(r["step"] for r in recs) and recs[-1]["step"] == 4
  assert torn not in (run / "metrics.jsonl").read_text().splitlines()


def test_resume_fails_clearly_when_no_checkpoint_restores(tmp_path, finished_run):
  run = tmp_path / "run"
  shutil.copytree(finished_run, run)
  _garbage_metadata(run / "ckpt" / "4")
  _truncate_largest_array_file(run / "ckpt" / "2")
  with pytest.raises(
    train.SetupError, match=r"no checkpoint .* restores \(step 4: JSONDecodeError.*; step 2: "
  ):
    train.main(SMALL + ["--steps", "4", "--out", str(run), "--resume"])


def test_resume_with_fewer_steps_than_the_checkpoint(tmp_path, finished_run):
  run = tmp_path / "run"
  shutil.copytree(finished_run, run)
  with pytest.raises(train.SetupError, match="--steps 3 is below step 4 of the checkpoint"):
    train.main(SMALL + ["--steps", "3", "--out", str(run), "--resume"])
  summary = train.main(SMALL + ["--steps", "4", "--out", str(run), "--resume"])
  assert summary["steps"] == 4 and summary["resumed_from"] == 4


@pytest.mark.parametrize(
  "lines,want",
  [
    (['{"step": 1, "loss": 2.0}', '{"step": 2, "lo'], [1]),
    (['{"step": 1, "loss": 2.0}', '{"step": 2}', ""], [1, 2]),
    (['{"step": 1, "loss": 2.0}', "[1, 2]"], [1]),
    (['{"step": 1}', '{"step": "2"}'], [1]),
    (["\x00\x00"], []),
  ],
)
def test_read_records_drops_only_a_torn_last_line(tmp_path, lines, want):
  f = tmp_path / "metrics.jsonl"
  f.write_text("\n".join(lines))
  assert [r["step"] for r in train.read_records(f)] == want


def test_read_records_rejects_damage_before_the_last_line(tmp_path):
  f = tmp_path / "metrics.jsonl"
  f.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
  with pytest.raises(train.SetupError, match="metrics.jsonl: line 2 is not a metrics record"):
    train.read_records(f)


def test_small_replicated_arrays_save_without_compiling(tmp_path):
  """A checkpoint of small replicated arrays is written whole by one replica: orbax's
  default would compile a slice program per array and replica at the first save."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "pipe"))
  rep = jax.NamedSharding(mesh, jax.P())
  params = {f"w{i}": jax.device_put(np.full((4, 8 + i), i, np.float32), rep) for i in range(6)}
  state = checkpoint.State(params, {"mu": params}, None, step=1)
  compiled = []

  def listen(event: str, secs: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(secs)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    checkpoint.save(checkpoint.checkpointer(tmp_path), state)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiled == []
  got = _restore(tmp_path, 1)
  np.testing.assert_array_equal(got["params"]["w5"], params["w5"])
