"""Error probe, tuner search and adaptive policy (models.error_probe, models.tune,
models.adaptive): a hand-computed error case, the search on a toy cost model, and the
adaptive policy's log, checkpoint and resume on the tiny model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jcoccl
from jcoccl.policy import Policy
from models import adaptive, directed, directions, error_probe, tune
from models.configs.models import TINY_RUN
from models.recipe import Recipe


def test_relative_error_is_the_hand_computed_one():
  # int2 (symmetric, one level): scale = max|x| = 4, codes round(x / 4) = [1, 0, -1, 0]
  # (0.5 rounds to even), decoded [4, 0, -4, 0]; error [0, 1, -1, 2]: sqrt(6) / sqrt(30).
  x = jnp.array([4.0, 1.0, -3.0, 2.0])
  assert error_probe.relative_error(x, "int2") == pytest.approx(math.sqrt(6 / 30), rel=1e-6)
  assert error_probe.relative_error(x, "none") == 0.0


def test_tap_measures_the_data_sum_error_and_noise_across_shards():
  """Two data shards g1, g2: the noise is ||g1 - g2|| / ||g1 + g2||; the int4 sum's error is
  that of jcoccl.all_reduce against the exact sum, computed independently."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  rng = np.random.default_rng(0)
  g_host = rng.standard_normal((2, 512)).astype(np.float32)
  g = jax.device_put(g_host, jax.sharding.NamedSharding(mesh, P("data")))
  codec, sr = directions.parse_codec("int4"), directions.parse_codec("int4:stochastic")
  tap = error_probe.Tap({"data": [("int4", codec), ("int4sr", sr)]})
  coll = directed.DirectedCollectives(Policy(), tap=tap)
  f = jax.shard_map(
    lambda v: coll.all_reduce(v[0], "data")[None],
    mesh=mesh,
    in_specs=P("data"),
    out_specs=P("data"),
  )
  out = jax.jit(f)(g)
  jax.effects_barrier()
  total = g_host.sum(0)
  np.testing.assert_allclose(out[0], total, rtol=1e-5)  # the step itself ran exact
  assert tap.noise_ratio() == pytest.approx(
    np.linalg.norm(g_host[0] - g_host[1]) / np.linalg.norm(total), rel=1e-4
  )

  def rel_err(comp, key=None):  # jcoccl's sum of the two shards against the exact sum
    f = jax.shard_map(
      lambda v: jcoccl.all_reduce(v[0], "data", compressor=comp, key=key, min_bytes=0)[None],
      mesh=mesh,
      in_specs=P("data"),
      out_specs=P("data"),
    )
    return np.linalg.norm(np.asarray(jax.jit(f)(g)[0]) - total) / np.linalg.norm(total)

  want = rel_err(codec)
  assert tap.errors()["data"]["int4"] == pytest.approx(want, rel=1e-4)
  # A stochastic codec is measured with its fixed key (the codec's index folded into key 0).
  want_sr = rel_err(sr, jax.random.fold_in(jax.random.key(0), 1))
  assert tap.errors()["data"]["int4sr"] == pytest.approx(want_sr, rel=1e-4)
  assert want_sr != want
  assert coll.points_log == [("data", (512,), jnp.dtype("float32"))]


def test_directions_are_checked():
  with pytest.raises(ValueError, match="unknown point 'tensor.sideways'"):
    directions.check_directions({"tensor.sideways": "int4"})
  assert directions.check_directions({"pipe.backward": "exact"}) == {"pipe.backward": None}


# -- the tuner's search on a toy cost model ---------------------------------------------------


def _toy(bits=(2, 3, 4, 5, 6, 8)):
  """Cost: bytes proportional to bits (tensor carries 4x pipe's); score: 2^-b errors."""
  out = []
  for bt, bp in itertools.product(bits, bits):
    s = math.sqrt((2.0**-bt) ** 2 + (0.5 * 2.0**-bp) ** 2)
    out.append(tune.Candidate((("tensor", bt), ("pipe", bp)), s, 4 * bt + bp))
  return out


def test_frontier_rises_in_cost_and_falls_in_score():
  front = tune.frontier(_toy())
  assert [c.cost for c in front] == sorted(c.cost for c in front)
  assert all(a.score > b.score for a, b in itertools.pairwise(front))
  assert len({c.cost for c in front}) == len(front)


@pytest.mark.parametrize("limit", [0.02, 0.05, 0.1, 0.3])
def test_search_finds_the_cheapest_passing_candidate(limit):
  cands = _toy()
  best, tried = tune.search(cands, lambda c: c.score <= limit, max_runs=10)
  feasible = [c for c in cands if c.score <= limit]
  assert best is not None and best.cost == min(c.cost for c in feasible)
  # Bisection: about log2 of the frontier's length.
  assert len(tried) <= math.ceil(math.log2(len(tune.frontier(cands)) + 1))


def test_search_reports_none_when_nothing_passes_and_respects_max_runs():
  best, tried = tune.search(_toy(), lambda c: False, max_runs=2)
  assert best is None and len(tried) == 2


def test_score_adds_points_in_quadrature():
  injected = {"tensor.forward": {"int4": 0.1}, "pipe.backward": {"int3": 0.3}}
  sens = {"tensor.forward": 0.5, "pipe.backward": 0.2}
  got = tune.score({"tensor": 4, "pipe": 3}, injected, sens, noise=0.5)
  assert got == pytest.approx(math.hypot(0.05, 0.06) / 0.5)


def test_the_data_axis_joins_the_search(tmp_path):
  # Messages of one traced step: point, shape, dtype (a 'data' point has no direction).
  msgs = [("tensor.forward", (512,), np.float32), ("tensor.backward", (512,), np.float32),
          ("pipe.forward", (256,), np.float32), ("data", (1024,), np.float32)]  # fmt: skip
  bits = tune.search_bits("3,4", "4,8")
  costs = tune.axis_costs(msgs, bits, "bytes", {}, {"tensor": 2, "pipe": 2, "data": 2})
  one = jcoccl.compressors.parse("hadamard(int8)").payload_nbytes(1024, np.float32)
  assert costs["data"][8] == one and costs["data"][4] < one
  assert costs["tensor"][4] > costs["pipe"][4] > 0
  injected = {p: {"int3": 0.3, "int4": 0.1, "int8": 0.01} for p in ("tensor.forward", "data")}
  probe = {"injected": injected, "sensitivity": {"tensor.forward": 1.0, "data": 2.0}, "noise": 1.0}
  cands = tune.candidates(probe, costs, bits)
  assert len(cands) == 2 * 2 * 2
  by = {c.name: c for c in cands}
  assert by["t4-p3-d8"].score == pytest.approx(math.hypot(0.1, 0.02))
  assert by["t4-p3-d8"].cost == costs["tensor"][4] + costs["pipe"][3] + costs["data"][8]
  (tmp_path / "p.toml").write_text(tune.policy_toml(by["t3-p4-d8"], None, []))
  recipe = Recipe.from_toml(str(tmp_path / "p.toml"))
  assert recipe.error_feedback
  assert recipe.source["data"]["all_reduce"] == "hadamard(int8)"
  assert recipe.source["tensor"]["all_reduce"] == "hadamard(int3)"
  with pytest.raises(ValueError, match="--data-bits"):
    tune.search_bits("4", "1,4")
  # A stochastic twin: the activations round stochastically, 'data' (error feedback) not.
  twin = by["t3-p4-d8"].twin()
  assert twin.name == "t3s-p4s-d8" and twin.cost == by["t3-p4-d8"].cost
  (tmp_path / "s.toml").write_text(tune.policy_toml(twin, None, []))
  recipe = Recipe.from_toml(str(tmp_path / "s.toml"))
  assert recipe.source["tensor"]["all_reduce"] == "hadamard(int3:stochastic)"
  assert recipe.source["pipe"]["ppermute"] == "hadamard(int4:stochastic)"
  assert recipe.source["data"]["all_reduce"] == "hadamard(int8)"


def test_search_tries_the_stochastic_twin_of_a_failing_point():
  """With --roundings nearest,stochastic a failing frontier point is measured again as its
  twin (the same bytes) before the search moves to dearer points; only nearest: never."""
  front = tune.frontier(_toy())
  mid = front[(len(front) - 1) // 2]
  # Nearest passes only from mid's score down; stochastic passes one point cheaper too.
  cheaper = front[(len(front) - 1) // 2 - 1]
  ok = lambda c: c.score <= mid.score or (c.stochastic and c.score <= cheaper.score)
  best, tried = tune.search(_toy(), ok, max_runs=20)
  assert best == mid and not any(c.stochastic for c, _ in tried)
  best, tried = tune.search(_toy(), ok, max_runs=20, roundings=("nearest", "stochastic"))
  assert best == cheaper.twin()
  assert (cheaper, False) in tried and (cheaper.twin(), True) in tried
  assert tune.parse_roundings("nearest, stochastic") == ("nearest", "stochastic")
  with pytest.raises(ValueError, match="--roundings must be nearest or nearest,stochastic"):
    tune.parse_roundings("stochastic")


def test_budget_parses():
  assert tune.parse_budget("1%") == pytest.approx(0.01)
  with pytest.raises(ValueError, match="--budget"):
    tune.parse_budget("-1%")


# -- the adaptive controller ------------------------------------------------------------------


def _measured(tf3, noise=0.5):
  inj = {p: {"int3": 0.3, "int4": 0.15, "int8": 0.01} for p in directions.DIRECTED}
  inj["tensor.forward"]["int3"] = tf3
  return {"injected": inj, "noise": noise, "sensitivity": dict.fromkeys(directions.DIRECTED, 0.5)}


def test_adaptive_chooses_bits_under_the_budget_and_bounds_programs():
  a = adaptive.Adaptive(directions.AdaptConfig(budget=0.5, bits=(3, 4, 8), max_programs=2))
  # share = 0.5 / 2 x 0.5 = 0.125: 0.5 x 0.15 = 0.075 passes at int4, int3 (0.15) does not.
  rec = a.update(0, _measured(tf3=0.3))
  assert rec["bits"] == dict.fromkeys(directions.DIRECTED, 4) and rec["from"]["pipe.forward"] == 8
  # tensor.forward's int3 error falls under the hysteresis (0.7 x share): it drops to 3 bits.
  assert a.update(10, _measured(tf3=0.1))["bits"]["tensor.forward"] == 3
  assert len(a.programs) == 2
  # A third bit set would exceed max_programs: the compiled set with at least its bits wins.
  m = _measured(tf3=0.1)
  m["injected"]["pipe.backward"]["int4"] = 0.5
  rec = a.update(20, m)
  assert rec is None or "nearest compiled" in rec["reason"] or "kept" in rec["reason"]
  assert len(a.programs) == 2


def test_adaptive_state_round_trips():
  a = adaptive.Adaptive(directions.AdaptConfig(budget=0.5, bits=(3, 4, 8)))
  a.update(0, _measured(tf3=0.3))
  a.count_step()
  b = adaptive.Adaptive(a.config)
  b.load(json.loads(json.dumps(a.state_dict())))
  assert b.state_dict() == a.state_dict()
  assert a.directions()["tensor.forward"] == "hadamard(int4)"
  sr = adaptive.Adaptive(dataclasses.replace(a.config, rounding="stochastic"))
  assert sr.directions(a.bits)["tensor.forward"] == "hadamard(int4:stochastic)"
  with pytest.raises(ValueError, match="--adapt-rounding nearest, this run --adapt-rounding sto"):
    sr.load(a.state_dict())


@pytest.mark.slow
def test_adaptive_training_logs_checkpoints_and_resumes(tmp_path):
  """A run adapting every 2 steps, and a copy of it resumed from its step-2 checkpoint with
  the same flags, end with the same adaptive state: the resumed run continued the saved
  controller (bits, history, sensitivities) instead of starting a new one. (Same --steps:
  the resumed run's train step is the same program, which the compile cache serves.)"""
  from models import train
  from models.checkpoint import checkpointer, saved_adaptive

  a, b = tmp_path / "a", tmp_path / "b"
  argv = [*TINY_RUN, "--steps", "4", "--eval-every", "4", "--ckpt-every", "2", "--warmup", "1"]
  argv += ["--no-progress", "--no-exact-twin", "--sample-tokens", "0"]
  # One adapted point and one program: the cheapest run that logs, saves and resumes.
  argv += ["--adapt", "0.5", "--adapt-every", "2", "--adapt-bits", "3,8"]
  argv += ["--adapt-max-programs", "1", "--adapt-points", "tensor.backward", "--no-hlo-wire"]
  argv += ["--adapt-rounding", "stochastic"]  # keys per call, and the probe's own
  s = train.main(argv + ["--out", str(a)])
  logged = [json.loads(l) for l in (a / "metrics.jsonl").read_text().splitlines()]
  changes = [r["adapt"] for r in logged if "adapt" in r]
  assert changes and changes[0]["step"] == 0 and changes == s["adaptive"]["changes"]
  assert sum(s["adaptive"]["steps_at"].values()) == 4
  saved = saved_adaptive(checkpointer(a), 4)
  assert saved["bits"] == s["adaptive"]["bits"] and saved["changes"] == changes
  # An interrupted copy of run a: its checkpoint at step 2 and the metrics up to then.
  shutil.copytree(a, b)
  shutil.rmtree(b / "ckpt" / "4")
  r = train.main(argv + ["--out", str(b), "--resume"])
  assert r["resumed_from"] == 2
  for key in ("changes", "sensitivity", "steps_at", "bits"):
    assert r["adaptive"][key] == s["adaptive"][key], key
  assert r["val_loss_end"] == s["val_loss_end"]  # stochastic rounding resumes bit-exactly
  assert saved_adaptive(checkpointer(b), 4) == saved


def test_a_candidate_passes_only_within_the_budget_by_both_measures():
  wire = lambda c, u: {"total": {"compressed": c, "uncompressed": u}}
  exact = {"val_loss_end": 2.0, "wire": wire(100.0, 100.0)}
  run = lambda own, through: {
    "val_loss_end": own, "val_loss_exact_collectives": through, "wire": wire(25.0, 100.0)
  }  # fmt: skip
  j = tune.judge(run(2.01, 2.015), exact, 0.01)
  assert j["passes"] and j["bytes_ratio"] == 0.25
  assert j["vs_exact"] == pytest.approx(0.005) and j["vs_exact_collectives"] == pytest.approx(
    0.0075
  )
  # Co-adapted: good through its own collectives, over the budget through exact ones.
  assert not tune.judge(run(2.01, 2.03), exact, 0.01)["passes"]
  assert not tune.judge(run(2.03, 2.01), exact, 0.01)["passes"]
  assert not tune.judge(run(2.01, None), exact, 0.01)["passes"]  # not measured: no pass
  md = tune.report_md(
    {
      "command": "python -m models.tune ...", "budget": 0.01, "objective": "bytes",
      "cost_source": "bytes", "exact": {"val_loss": 2.0}, "probe": {"noise": 0.1},
      "frontier": [], "chosen": None,
      "tried": [{"name": "t4-p4", "score": 0.1, "cost": 1.0, **tune.judge(run(2.01, 2.03), exact, 0.01)}],
    }
  )  # fmt: skip
  assert "| t4-p4 | 0.100 | 1 | 2.0100 | +0.50% | +1.50% | 0.250 | no |" in md
