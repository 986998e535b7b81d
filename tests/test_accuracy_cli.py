"""``python -m benchmarks.accuracy.run`` on a tiny budget: two policies, one seed, one model;
the table, JSON and plot are written from what the runs report, a missing policy file is
skipped with a message, and a finished run is read back instead of trained again; its
checkpoint evaluates again through its own and through exact collectives (exact_eval)."""

import json

import pytest

from benchmarks.accuracy import exact_eval
from benchmarks.accuracy import run as study


@pytest.mark.slow
def test_two_policies_one_seed(tmp_path, capsys):
  out = tmp_path / "acc"
  argv = [
    "--tiny",
    "--models",
    "gpt",
    "--policies",
    "exact,int8,no_such_policy",
    "--seeds",
    "1",
    "--dtypes",
    "float32,bfloat16",
    "--steps",
    "2",
    "--out",
    str(out),
  ]
  result = study.main(argv)
  text = capsys.readouterr()
  assert "policy 'no_such_policy' skipped" in text.err
  rows = {r["policy"] + study.DTYPE_TAG[r["dtype"]]: r for r in result["table"]}
  assert set(rows) == {"exact", "int8", "exact-bf16", "int8-bf16"}
  exact, int8 = rows["exact"], rows["int8"]
  assert exact["byte_ratio"] == 1.0 and exact["val_ratio"] == 1.0
  # int8 sends a quarter of float32's bytes plus per-block scales, on every axis.
  assert 0.25 < int8["byte_ratio"] < 0.3
  for axis in ("data", "tensor", "pipe"):
    assert 0 < int8["bytes_by_axis"][axis] < exact["bytes_by_axis"][axis]
  assert int8["bytes_by_axis"]["other"] == 0
  # bfloat16: the exact baseline sends half of float32's bytes (bar the float32 loss and
  # norm scalars), the codec's payload is the same, so its ratio to its own baseline doubles.
  assert 0.5 <= rows["exact-bf16"]["byte_ratio_f32"] < 0.51
  assert rows["int8-bf16"]["bytes"] == int8["bytes"]
  assert rows["int8-bf16"]["byte_ratio"] == pytest.approx(
    int8["bytes"] / rows["exact-bf16"]["bytes"]
  )
  assert rows["exact-bf16"]["val_ratio"] == 1.0 and rows["exact-bf16"]["val_ratio_f32"] > 0
  # The table repeats what each run's summary.json reports.
  for r in result["runs"]:
    summary = json.loads((tmp_path / r["dir"] / "summary.json").read_text())
    assert r["val_loss"] == summary["val_loss_end"]
    assert r["val_loss_exact_collectives"] == summary["val_loss_exact_collectives"]
    assert r["bytes"] == summary["wire"]["total"]["compressed"]
    assert sum(r["bytes_by_axis"].values()) == pytest.approx(r["bytes"])
  assert int8["val_ratio"] == pytest.approx(
    result["runs"][1]["val_loss"] / result["runs"][0]["val_loss"]
  )
  assert [r["dtype"] for r in result["runs"]] == ["float32"] * 2 + ["bfloat16"] * 2
  on_disk = json.loads((out / "results.json").read_text())
  assert on_disk["table"] == json.loads(json.dumps(result["table"]))
  md = (out / "results.md").read_text()
  assert "| gpt | float32 | int8 | 1 |" in md and "| gpt | bfloat16 | int8 | 1 |" in md
  assert "no_such_policy" in md
  assert (out / "val_loss_vs_bytes.png").stat().st_size > 5000
  # Run again: every run is read back, not trained.
  again = study.main(argv)
  assert all(r["reused"] for r in again["runs"])
  assert again["table"] == result["table"]
  # The float32 runs' checkpoints, evaluated again: the own-policy loss reproduces
  # val_loss_end (exact_eval raises otherwise); only int8's changes with exact collectives.
  dirs = [tmp_path / r["dir"] for r in result["runs"][:2]]
  ex, q = exact_eval.main([str(d) for d in dirs])
  assert ex["val_loss_exact_collectives"] == ex["val_loss"] == result["runs"][0]["val_loss"]
  assert q["val_loss"] == result["runs"][1]["val_loss"]
  assert q["val_loss_exact_collectives"] != q["val_loss"]
  # models.train's own exact-collective column is the same measurement.
  assert [r["val_loss_exact_collectives"] for r in result["runs"][:2]] == pytest.approx(
    [ex["val_loss_exact_collectives"], q["val_loss_exact_collectives"]], rel=1e-6
  )
  assert int8["val_ratio_exact_collectives"] == pytest.approx(
    q["val_loss_exact_collectives"] / ex["val_loss"], rel=1e-6
  )
  assert "| its val / exact |" in md


@pytest.mark.parametrize(
  "argv,match",
  [
    (["--models", "gpt,bert"], "--models must be"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--dtypes", "float32,float16"], "--dtypes must be"),
    (["--policies", "nope1,nope2"], "none of --policies"),
  ],
)
def test_bad_flags(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    study.parse_args(argv)
  assert e.value.code == 2 and match in capsys.readouterr().err


def test_columns_fold_zeropp_levels_into_data():
  cols = study.columns(
    {"node": 3.0, "data": 4.0, "tensor": 5.0, "pipe": 6.0, "data,tensor": 1.0, "?": 2.0}
  )
  assert cols == {"data": 7.0, "tensor": 5.0, "pipe": 6.0, "other": 3.0}
