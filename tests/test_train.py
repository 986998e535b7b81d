"""The training script end to end (``models.train.main``, the ``python -m models.train`` entry
point) with tiny settings: loss falls (also in ZeRO mode); a resumed run reproduces an
uninterrupted one exactly."""

import json
import shutil

import jax
import numpy as np
import pytest

from models import train

TINY = ["--size", "tiny", "--batch", "8", "--seq-len", "32", "--micro", "2", "--lr", "1e-2",
        "--warmup", "5", "--max-chars", "200000", "--eval-batches", "2", "--no-progress"]


def _restore(out, step):
  import orbax.checkpoint as ocp
  mngr = train._checkpointer(out)
  assert step in mngr.all_steps()
  return mngr.restore(step, args=ocp.args.StandardRestore())


def test_loss_drops_and_outputs_written(tmp_path, capsys):
  out = tmp_path / "run"
  summary = train.main(TINY + ["--steps", "40", "--eval-every", "20", "--out", str(out)])
  assert summary["loss_end"] < summary["loss_start"] - 0.8, summary
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  vals = [r["val_loss"] for r in recs if "val_loss" in r]
  assert len(vals) == 2 and vals[1] < vals[0]
  assert (out / "loss.png").stat().st_size > 1000
  # Warmup starts at lr/warmup, so the first optimizer step already moves the weights.
  first = next(r for r in recs if "loss" in r)
  assert first["step"] == 1 and first["lr"] == pytest.approx(1e-2 / 5)
  wire = summary["wire"]
  assert wire["source"].startswith("measured: jcoccl.wire_bytes")
  assert set(wire["by_axis"]) == {"data", "tensor", "pipe"}
  assert all(0 < r["compressed"] < r["uncompressed"] for r in wire["by_axis"].values())
  assert wire["total"]["compressed"] == pytest.approx(
      sum(r["compressed"] for r in wire["by_axis"].values()))
  assert [r["wire"] for r in recs if "wire" in r] == [wire]
  text = capsys.readouterr().out
  assert "tokens/s" in text and "by mesh axis (measured" in text


@pytest.mark.parametrize("policy", ["exact", "coccl", "coccl --zero"])
def test_resume_reproduces_uninterrupted_run(tmp_path, policy):
  common = TINY + ["--policy", *policy.split(), "--mesh", "2,1,2", "--ckpt-every", "3",
                   "--eval-every", "100", "--no-hlo-wire"]
  a, b = tmp_path / "a", tmp_path / "b"
  train.main(common + ["--steps", "6", "--out", str(a)])
  # An interrupted copy of run a: its checkpoint at step 3 and the metrics up to then.
  shutil.copytree(a, b)
  shutil.rmtree(b / "ckpt" / "6")
  summary = train.main(common + ["--steps", "6", "--out", str(b), "--resume"])
  assert summary["resumed_from"] == 3 and summary["steps"] == 6
  assert summary["wire"]["source"] is None and "--no-hlo-wire" in summary["wire"]["note"]
  ta, tb = _restore(a, 6), _restore(b, 6)
  assert int(tb["step"]) == 6
  leaves_a, leaves_b = jax.tree.leaves(ta), jax.tree.leaves(tb)
  assert len(leaves_a) == len(leaves_b) > 10
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  steps = [json.loads(l)["step"] for l in (b / "metrics.jsonl").read_text().splitlines()]
  assert steps == sorted(steps) and steps[-1] == 6


def test_zero_loss_drops(tmp_path):
  """ZeRO mode (--zero) under the coccl policy: int4 reduce_scatter with error feedback,
  AdamW state sharded over 'data'."""
  out = tmp_path / "zero"
  summary = train.main(TINY + ["--zero", "--steps", "20", "--eval-every", "100",
                               "--out", str(out)])
  assert summary["loss_end"] < summary["loss_start"] - 0.5, summary
  wire = summary["wire"]["by_axis"]["data"]
  assert 0 < wire["compressed"] < wire["uncompressed"], wire
  # The checkpoint holds the AdamW moments as flat shards over 'data'.
  mu = _restore(out, 20)["opt_state"][0]["mu"]
  assert all(a.ndim == 1 and "data" in a.sharding.spec[0] for a in jax.tree.leaves(mu))


def test_bad_flags(tmp_path):
  with pytest.raises(SystemExit):
    train.parse_args(["--mesh", "2,2"])
  with pytest.raises(ValueError, match="--policy must be"):
    train.main(TINY + ["--policy", "nope", "--out", str(tmp_path)])
  with pytest.raises(ValueError, match="no checkpoint"):
    train.main(TINY + ["--steps", "1", "--resume", "--out", str(tmp_path / "empty")])
