"""Test set-up: 8 host CPU devices, so that collectives run on 1 to 8 ranks.

Tests marked ``unoptimized`` (the model, training and CLI tests) compile with
``jax_disable_most_optimizations`` (XLA's backend at optimization level 0), and so do the
processes they start: compiling their large programs is most of their time, and what they
check (one run equals another, a loss falls, a bound holds, a file is written) holds at any
optimization level. The codec and collective tests compile as users do, because XLA's
optimizations (constant folding, fused multiply-adds) are what could move a jnp reference
off a native kernel's bits.
"""

import contextlib
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_FLAG = "jax_disable_most_optimizations"


@contextlib.contextmanager
def _unoptimized() -> Iterator[None]:
  import jax

  before = jax.config._read(_FLAG)  # a flag, not a state: no attribute, no context manager
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(_FLAG.upper(), "1")  # the processes the test starts read it at import
    jax.config.update(_FLAG, True)
    try:
      yield
    finally:
      jax.config.update(_FLAG, before)


@pytest.fixture(autouse=True, scope="module")
def _unoptimized_module(request: pytest.FixtureRequest) -> Iterator[None]:
  """``pytestmark = pytest.mark.unoptimized``: the module's own fixtures compile so too
  (autouse fixtures set up before the other fixtures of their scope)."""
  marks = getattr(request.module, "pytestmark", [])
  marks = marks if isinstance(marks, list) else [marks]
  with _unoptimized() if any(m.name == "unoptimized" for m in marks) else contextlib.nullcontext():
    yield


@pytest.fixture(autouse=True)
def _unoptimized_test(request: pytest.FixtureRequest) -> Iterator[None]:
  """One test marked ``@pytest.mark.unoptimized``."""
  marked = any(m.name == "unoptimized" for m in request.node.own_markers)
  with _unoptimized() if marked else contextlib.nullcontext():
    yield
