"""Test set-up: 8 host CPU devices, so that collectives run on 1 to 8 ranks.

Tests compile with ``jax_disable_most_optimizations`` (XLA's backend at optimization level
0; the HLO passes still run), and so do the processes they start: compiling is most of the
suite's time, and what the tests check (a bound holds, one run equals another, lax semantics,
totality over any bytes) holds at any optimization level. Tests marked ``optimized`` compile
as users do. They are the native codec bit-exactness tests in float32: at its default level
XLA:CPU contracts ``a*b + c`` into an FMA, which is what moves a jnp product that the
specification left unguarded off the kernels' bits. ``unoptimized`` marks the exceptions
inside an ``optimized`` module. ``JCOCCL_TEST_OPTIMIZED=1`` compiles everything as users do.
"""

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Runs without --out (models.run_config.runs_dir) go to a directory of this test process,
# never to the working tree's runs/, which a user's `python -m models.train` fills; the
# processes the tests start inherit it.
_RUNS = tempfile.mkdtemp(prefix="jcoccl-test-runs-")
os.environ["JCOCCL_RUNS_DIR"] = _RUNS
atexit.register(shutil.rmtree, _RUNS, True)

_FLAG = "jax_disable_most_optimizations"
_ALL_OPTIMIZED = os.environ.get("JCOCCL_TEST_OPTIMIZED", "") == "1"
if not _ALL_OPTIMIZED:
  os.environ[_FLAG.upper()] = "1"  # the processes the tests start read it at import
  import jax

  jax.config.update(_FLAG, True)  # in case a plugin imported jax before this file


def _unoptimized(marks: list) -> bool | None:
  """What ``marks`` ask: True unoptimized, False optimized, None the enclosing default."""
  names = {m.name for m in marks}
  if _ALL_OPTIMIZED or not names & {"optimized", "unoptimized"}:
    return None
  return "optimized" not in names


@contextlib.contextmanager
def _compiled(unoptimized: bool | None) -> Iterator[None]:
  if unoptimized is None:
    yield
    return
  import jax

  before = jax.config._read(_FLAG)  # a flag, not a state: no attribute, no context manager
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(_FLAG.upper(), "1" if unoptimized else "0")  # the processes the test starts
    jax.config.update(_FLAG, unoptimized)
    try:
      yield
    finally:
      jax.config.update(_FLAG, before)


@pytest.fixture(autouse=True, scope="module")
def _module_level(request: pytest.FixtureRequest) -> Iterator[None]:
  """A module's ``pytestmark``; the module's own fixtures compile so too (autouse fixtures
  set up before the other fixtures of their scope)."""
  marks = getattr(request.module, "pytestmark", [])
  with _compiled(_unoptimized(marks if isinstance(marks, list) else [marks])):
    yield


@pytest.fixture(autouse=True)
def _test_level(request: pytest.FixtureRequest) -> Iterator[None]:
  """A test's own marks (``pytest.param(..., marks=...)`` included)."""
  with _compiled(_unoptimized(request.node.own_markers)):
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Modules with ``slow`` tests first, each module kept whole (its fixtures set up once):
  the xdist workers then end on short tests instead of one idling while the other finishes
  a long one."""

  def module(item: pytest.Item) -> object:
    return getattr(item, "module", None) or item.parent

  slow = {module(item) for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: module(item) not in slow)
