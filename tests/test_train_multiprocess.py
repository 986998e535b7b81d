"""``python -m models.train`` across processes (``python -m jcoccl.launch -n 2
--devices-per-process 4``): the same training as one process with 8 devices, process 0's
outputs, the wire report's split between processes, a run stopped by SIGTERM and resumed,
the same adaptive decisions on every process, and a process killed mid-training.

Why the runs must agree bit for bit: both run the same SPMD program on the same 2x2x2 mesh
(data rank = process, tensor x pipe = its 4 devices) with the same data, and every
cross-device sum in it has two terms (each of 'data', 'tensor' and 'pipe' has size 2; the
compressed collectives decode and add in rank order themselves), and a two-term float sum is
the same in either order. So no reduction order of gloo or of XLA's in-process collectives
can tell the runs apart: any difference is a bug.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import jax
import mp_train_worker
import numpy as np
import pytest
from mp_util import kill_when_ready

import jcoccl
from models import checkpoint, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_train_worker.py")
STEPS = 6
# The coccl policy: lossy compressors on every axis, error feedback on 'data'.
ARGS = [
  "--size",
  "tiny",
  "--mesh",
  "2,2,2",
  "--batch",
  "8",
  "--seq-len",
  "32",
  "--micro",
  "2",
  "--lr",
  "1e-2",
  "--warmup",
  "2",
  "--max-chars",
  "100000",
  "--eval-batches",
  "1",
  "--eval-every",
  "100",
  "--ckpt-every",
  "2",
  "--log-every",
  "1",
  "--steps",
  str(STEPS),
  "--no-progress",
  "--no-exact-twin",  # what is compared is the run itself (a resumed run has no twin)
  # auto may choose the exact op on 'data'. The runs calibrate at start with a crafted
  # table (mp_train_worker.crafted; measured timings would differ between one process and
  # two), under which 'data' compresses.
  "--compress",
  "data.all_reduce=auto:hadamard(int4)",
]


def _launch_cmd(*argv: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "jcoccl.launch",
    "-n",
    "2",
    "--devices-per-process",
    "4",
    "--kill-after",
    "120",
    "--",
    sys.executable,
    *argv,
  ]


def _launch(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run(_launch_cmd(*argv), cwd=ROOT, capture_output=True, text=True, timeout=600)


def _checkpoint(out, step: int, like=None) -> dict:
  """The checkpoint at ``step`` as a pytree, restored onto ``like``'s shapes and shardings
  (this process's 8-device mesh) when given."""
  import orbax.checkpoint as ocp

  mngr = checkpoint.checkpointer(out)
  try:
    assert step in mngr.all_steps(), (step, mngr.all_steps())
    if like is None:
      return mngr.restore(step, args=ocp.args.StandardRestore())
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return mngr.restore(step, args=ocp.args.StandardRestore(abstract))
  finally:
    mngr.close()


def _assert_same_state(got: dict, want: dict) -> None:
  leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(leaves_got) == len(leaves_want) > 10
  for x, y in zip(leaves_got, leaves_want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _losses(out) -> dict[int, tuple]:
  """{step: (loss, val_loss)} of the logged steps in metrics.jsonl."""
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: (r["loss"], r.get("val_loss")) for r in recs if "loss" in r}


def _sigterm_at_step_3(out) -> int:
  """Runs the slowed worker on 2 processes and sends SIGTERM to process 1 alone while it
  waits to run step 3 (its line ``batch 2`` printed, the worker sleeping). Returns the step
  the run stopped at; the launch must have exited with 143."""
  # No periodic checkpoint on the way: the one at the stop is the signal's own.
  argv = [*ARGS, "--no-hlo-wire", "--out", str(out), "--ckpt-every", "100"]
  cmd = _launch_cmd(WORKER, "2", "3", *argv)
  _, text, rc = kill_when_ready(
    cmd, ROOT, r"\[(\d)\] pid (\d+)$", r"\[(\d)\] batch 2$", {0, 1}, 1, signal.SIGTERM
  )
  assert rc == 143, text[-3000:]
  stops = re.findall(
    r"^\[(\d)\] models\.train: stopped by SIGTERM at step (\d) of 6; checkpoint saved in "
    rf"{re.escape(str(out / 'ckpt'))}; resume with: start every process again with "
    r"python -m models\.train .* --ckpt-every 100 --resume$",
    text,
    re.M,
  )
  assert [rank for rank, _ in stops] == ["0"], text[-3000:]
  assert "models.train: SIGTERM: saving a checkpoint after the current step" in text
  assert "Traceback" not in text, text[-3000:]
  return int(stops[0][1])


@pytest.mark.slow
def test_two_processes_train_as_one_stop_on_sigterm_and_resume(tmp_path, monkeypatch):
  """One scenario, three checks (CI time: two launches in all):
  1. 2 processes x 4 devices train exactly as 1 process x 8 devices (losses of the steps
     before the stop);
  2. SIGTERM (a cluster's preemption notice) to process 1 alone before step 3 stops both
     after the same step (3, or 4 if the signal came late): a checkpoint of it, one line
     from process 0 naming the step and the resume command, exit status 143, no traceback;
  3. ``--resume`` on both processes continues from that checkpoint and ends bit for bit
     where the uninterrupted single-process run ends (parameters, AdamW state,
     error-feedback residuals; losses of the later steps), with process 0's outputs and the
     wire report split between processes ('data') and inside them ('tensor', 'pipe').
  Every run calibrates at start, with a crafted table under which 'data' compresses; the
  resume's processes would measure one under which it goes exactly, so they pass only by
  reusing the calibration saved with the checkpoint. (A process killed outright, kill -9,
  is test_adaptive_bits_are_the_same_on_every_process's end.)"""
  single, out = tmp_path / "single", tmp_path / "run"
  jcoccl.set_cost_model(None)
  monkeypatch.setattr(jcoccl, "calibrate", mp_train_worker.fake_calibrate(["compress"]))
  try:
    train.main(ARGS + ["--no-hlo-wire", "--out", str(single)])
  finally:
    jcoccl.set_cost_model(None)
  want = _losses(single)
  assert sorted(want) == list(range(1, STEPS + 1))

  monkeypatch.setenv("JCOCCL_TEST_CALIBRATION", "compress")
  stop = _sigterm_at_step_3(out)
  mngr = checkpoint.checkpointer(out)
  latest = mngr.latest_step()
  mngr.close()
  assert stop in (3, 4) and latest == stop
  got = _losses(out)
  assert set(got) == set(range(1, stop + 1)) and got == {s: want[s] for s in got}

  monkeypatch.setenv("JCOCCL_TEST_CALIBRATION", "exact")
  r = _launch(WORKER, "99", "0", *ARGS, "--out", str(out), "--resume")
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  ref = _checkpoint(single, STEPS)
  _assert_same_state(_checkpoint(out, STEPS, like=ref), ref)
  assert _losses(out) == want
  assert re.findall(r"^\[(\d)\] resumed with its calibration", r.stdout, re.M) == ["0"]
  saved = json.loads((out / "calibration.json").read_text())
  assert saved["cost_model"]["source"] == "test: compress wins"
  assert saved["reused_from_step"] == stop
  _check_lead_outputs(r.stdout, out, stop)


def _check_lead_outputs(stdout: str, out, start: int) -> None:
  """Process 0 alone reports (one summary line, one wire table); 'data' crosses processes."""
  assert re.findall(rf"^\[(\d)\] loss [\d.]+ -> .* over steps {start}\.\.6", stdout, re.M) == ["0"]
  assert "over 2 process(es)" in stdout
  # The end-of-run sample is drawn on process 0 from its own copy of the parameters.
  assert re.findall(r"^\[(\d)\] sample \(48 tokens", stdout, re.M) == ["0"]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == STEPS and summary["resumed_from"] == start
  assert (out / "loss.png").stat().st_size > 1000
  wire = summary["wire"]
  crossing = {a: row["crosses_processes"] for a, row in wire["by_axis"].items()}
  assert crossing == {"data": True, "tensor": False, "pipe": False}
  for part, axes in (("across_processes", ["data"]), ("inside_process", ["tensor", "pipe"])):
    for k in ("compressed", "uncompressed"):
      assert wire[part][k] == pytest.approx(sum(wire["by_axis"][a][k] for a in axes))
  assert 0 < wire["across_processes"]["compressed"] < wire["across_processes"]["uncompressed"]
  assert re.search(r"^\[0\]   across .* \(between processes", stdout, re.M)


_MESH_CHECK = """
import sys
import jcoccl
jcoccl.distributed.initialize()
from models import parallel
for shape in ((1, 8, 1), (1, 2, 2)):
  try:
    parallel.make_mesh(*shape)
  except ValueError as e:
    print("rejected", shape, e, flush=True)
m = parallel.make_mesh(4, 2, 1)  # 'data' partly inside a process: allowed
print("data crosses", parallel.crosses_processes(m, ("data",)),
      "tensor crosses", parallel.crosses_processes(m, ("tensor",)), flush=True)
"""


def test_mesh_across_processes_keeps_tensor_and_pipe_inside():
  r = _launch("-c", _MESH_CHECK)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  for rank in (0, 1):
    assert re.search(
      rf"^\[{rank}\] rejected \(1, 8, 1\) .*tensor x pipe = 8 must divide the 4 "
      rf"devices of each process",
      r.stdout,
      re.M,
    ), r.stdout
    assert re.search(rf"^\[{rank}\] rejected \(1, 2, 2\) .*must use all 8", r.stdout, re.M)
    assert f"[{rank}] data crosses True tensor crosses False" in r.stdout


def test_batch_is_the_same_global_batch_however_it_is_split():
  """make_batch + Corpus.windows give exactly Corpus.batch's rows (one process here; each
  process of a multi-process run asks only for its rows of the same starts)."""
  from models import data, parallel

  corpus = data.load_corpus("char", max_chars=20000)
  args = train.parse_args(["--batch", "8", "--seq-len", "16"])
  par = parallel.Parallel3D(
    train.build_model(args, corpus.vocab_size), parallel.make_mesh(2, 2, 2), n_micro=2
  )
  x, y = train.batch_at(corpus, args, par, "train", 5)
  rng = np.random.default_rng([args.seed, 5, 0, 0])
  want_x, want_y = corpus.batch(rng, "train", batch=8, seq_len=16)
  np.testing.assert_array_equal(np.asarray(x), want_x)
  np.testing.assert_array_equal(np.asarray(y), want_y)
  assert x.sharding == par.placement.batch_sharding()
  picked = corpus.windows("train", np.array([3, 7, 11]), 16)
  np.testing.assert_array_equal(
    picked[0], corpus.train[np.array([3, 7, 11])[:, None] + np.arange(16)]
  )


@pytest.mark.slow
def test_adaptive_bits_are_the_same_on_every_process(tmp_path, monkeypatch):
  """--adapt over 2 processes: each probe's measurements (injected errors, gradient noise,
  sensitivities) are sums over all 8 devices, the same on both processes, so both choose
  the same bits and compile the same programs. Every process prints each probe
  (mp_train_worker's JCOCCL_TEST_ADAPT_LOG); the lines must be equal. (Each process used
  to sum only its own devices' measurements: the noise differed, 0.190 against 0.162.)
  After the probes at steps 0 and 2, process 1 is killed (kill -9) before step 3: process 0
  stops by itself within 60 s with one clear line and no traceback."""
  argv = [*ARGS[: ARGS.index("--steps")], "--steps", "4", "--no-progress", "--no-exact-twin"]
  argv += ["--no-hlo-wire", "--no-calibrate", "--sample-tokens", "0", "--ckpt-every", "100"]
  argv += ["--adapt", "0.5", "--adapt-every", "2", "--adapt-bits", "3,8"]
  argv += ["--adapt-max-programs", "1", "--adapt-points", "data"]
  monkeypatch.setenv("JCOCCL_TEST_ADAPT_LOG", "1")
  cmd = _launch_cmd(WORKER, "3", "2", *argv, "--out", str(tmp_path / "run"))
  took, text, rc = kill_when_ready(
    cmd, ROOT, r"\[(\d)\] pid (\d+)$", r"\[(\d)\] batch 3$", {0, 1}, 1
  )
  assert rc != 0, text[-3000:]
  assert took < 60, f"process 0 took {took:.0f} s to stop"
  assert re.search(
    r"^\[0\] models\.train: a peer process failed: .*; resume with --resume$", text, re.M
  ), text[-3000:]
  assert "Traceback" not in text, text[-3000:]
  probes: dict[str, list] = {"0": [], "1": []}
  for rank, rec in re.findall(r"^\[(\d)\] adapt (\{.*\})$", text, re.M):
    probes[rank].append(json.loads(rec))
  assert [p["step"] for p in probes["0"]] == [0, 2], text[-3000:]
  assert probes["0"] == probes["1"]
  assert probes["0"][0]["noise"] > 0 and probes["0"][0]["injected"]["data"]["int3"] > 0
