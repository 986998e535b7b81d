"""all_reduce(algorithm="auto")'s cost model: the fit recovers known constants, a set or
loaded model decides auto's algorithm, and bad models or files are rejected by name."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import mesh

import jcoccl
from jcoccl._src.base import cost_model
from jcoccl._src.ops import auto_model


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
  monkeypatch.delenv("JCOCCL_COST_MODEL", raising=False)
  jcoccl.set_config_defaults(reload=True)
  yield
  monkeypatch.delenv("JCOCCL_COST_MODEL", raising=False)
  jcoccl.set_config_defaults(reload=True)


def _samples(m, ranks=(4, 8), ratio=0.254):
  return [
    dict(algorithm=a, bytes=b, ranks=n, ratio=ratio, seconds=m.cost(a, b, n, ratio))
    for a in ("one_shot", "two_shot")
    for b in (1 << 14, 1 << 18, 1 << 22, 1 << 24)
    for n in ranks
  ]


@pytest.mark.parametrize(
  "truth",
  [
    cost_model.CostModel(2e-4, 1.25e8, 3e9),
    cost_model.CostModel(5e-6, 25e9, 2e11),
    cost_model.CostModel(1e-3, 1e9, 5e8),
    cost_model.CostModel(8e-4, 3e8, 2e9, overhead_s=7e-3),
  ],
)
def test_fit_recovers_the_constants_of_exact_timings(truth):
  got = cost_model.fit(_samples(truth))
  for name in ("alpha_s", "beta_Bps", "gamma_Bps"):
    assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
  assert got.overhead_s == pytest.approx(truth.overhead_s, rel=1e-6, abs=1e-9)


def test_fit_chooses_the_measured_fastest():
  truth = cost_model.CostModel(3e-4, 1.2e8, 1.5e9)
  rng = np.random.default_rng(0)
  noisy = [dict(s, seconds=s["seconds"] * rng.uniform(0.97, 1.03)) for s in _samples(truth)]
  model = cost_model.fit(noisy)
  for b in (1 << 14, 1 << 24):
    for n in (4, 8):
      assert model.choose(b, n, 0.254) == truth.choose(b, n, 0.254)


def test_fit_needs_enough_timings():
  with pytest.raises(ValueError, match="at least 3"):
    cost_model.fit(_samples(cost_model.CostModel(1e-4, 1e8, 1e9))[:2])


@pytest.mark.parametrize(
  "field,value",
  [("alpha_s", 0.0), ("beta_Bps", -1.0), ("gamma_Bps", float("inf")), ("overhead_s", -1e-3)],
)
def test_cost_model_rejects_non_positive_constants(field, value):
  kw = dict(alpha_s=1e-4, beta_Bps=1e8, gamma_Bps=1e9)
  kw[field] = value
  with pytest.raises(ValueError, match=f"CostModel.{field}"):
    cost_model.CostModel(**kw)


def _auto_algorithm(n=4, elems=1 << 18):
  """The algorithm auto compiles to: two_shot is the one with an all-to-all."""
  m = mesh((n,), ("x",))
  x = jnp.ones((n, elems), jnp.float32)
  f = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.all_reduce(v, "x", compressor="int8", min_bytes=0),
      mesh=m,
      in_specs=jax.P("x"),
      out_specs=jax.P("x"),
    )
  )
  hlo = f.lower(x).compile().as_text()
  return "two_shot" if re.search(r"\ball-to-all\b", hlo) else "one_shot"


def test_set_model_decides_auto():
  jcoccl.set_cost_model(jcoccl.CostModel(1.0, 1e18, 1e18, "latency only"))
  assert _auto_algorithm() == "one_shot"  # fewer steps
  jcoccl.set_cost_model(jcoccl.CostModel(1e-9, 1e6, 1e18, "bandwidth only"))
  assert _auto_algorithm() == "two_shot"  # fewer bytes


def test_model_file_from_environment(tmp_path, monkeypatch):
  path = tmp_path / "m.json"
  path.write_text(
    json.dumps({"alpha_s": 1.0, "beta_Bps": 1e18, "gamma_Bps": 1e18, "source": "file"})
  )
  monkeypatch.setenv("JCOCCL_COST_MODEL", str(path))
  jcoccl.set_config_defaults(reload=True)  # the environment is read once
  assert auto_model.active().source == "file"
  assert _auto_algorithm() == "one_shot"


@pytest.mark.parametrize(
  "text,message",
  [
    ("{", "cannot be read"),
    ('{"alpha_s": 1}', "lacks beta_Bps, gamma_Bps"),
    ('{"alpha_s": 1, "beta_Bps": 0, "gamma_Bps": 1}', "beta_Bps must be a positive"),
  ],
)
def test_bad_model_file(tmp_path, text, message):
  path = tmp_path / "m.json"
  path.write_text(text)
  with pytest.raises(ValueError, match=message):
    jcoccl.load_cost_model(str(path))


def test_bench_fit_writes_a_loadable_model(tmp_path):
  import argparse

  from jcoccl.bench import collectives

  p = argparse.ArgumentParser()
  collectives.add_arguments(p)
  out = tmp_path / "fit.json"
  args = p.parse_args(
    [
      "--sizes",
      "16KiB,64KiB",
      "--ops",
      "all_reduce",
      "--compressors",
      "int8",
      "--algorithms",
      "one_shot,two_shot",
      "--iters",
      "1",
      "--fit-out",
      str(out),
    ]
  )
  assert collectives.run(args, []) == 0
  model = jcoccl.load_cost_model(str(out))
  assert "fit: 1 cpu processes" in model.source
  assert json.loads(out.read_text())["ranks"] == [8]


def test_auto_compares_compressed_candidates_and_the_exact_op_only_when_asked():
  """choose_auto: exact=False (algorithm "auto", a named codec) never returns the exact op,
  even where it is predicted 10x faster; exact=True returns it there. candidates lists
  what was compared, with the chunked variants only where chunks overlap."""
  fast_exact = cost_model.CostModel(1e-4, 1e8, 1e9, "t", exact_alpha_s=1e-5, exact_beta_Bps=1e10)
  s, n, r = 16 << 20, 8, 0.254
  assert cost_model.choose_auto(fast_exact, s, n, r) == ("exact", 1)
  assert cost_model.choose_auto(fast_exact, s, n, r, exact=False)[0] in ("one_shot", "two_shot")
  names = [k for k, _ in cost_model.candidates(fast_exact, s, n, r)]
  assert names == ["exact", "one_shot", "two_shot"]
  times = dict(cost_model.candidates(fast_exact, s, n, r, extra_s=1.0))
  assert times["one_shot"] == pytest.approx(fast_exact.cost("one_shot", s, n, r) + 1.0)
  overlapping = dataclasses.replace(fast_exact, overlap=1.0)
  assert "two_shot/4" in dict(cost_model.candidates(overlapping, s, n, r))
  uncalibrated = cost_model.CostModel(1e-4, 1e8, 1e9)
  assert "exact" not in dict(cost_model.candidates(uncalibrated, s, n, r))
