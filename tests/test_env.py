"""Settings read from environment variables: values, defaults and errors naming them."""

import pytest

import jcoccl
from jcoccl._src import _env
from jcoccl._src.native import distributed as D


def test_integer_default_value_and_range(monkeypatch):
  monkeypatch.delenv("JCOCCL_TEST_INT", raising=False)
  assert _env.integer("JCOCCL_TEST_INT", 7, 0) == 7
  monkeypatch.setenv("JCOCCL_TEST_INT", "")
  assert _env.integer("JCOCCL_TEST_INT", None, 0) is None
  monkeypatch.setenv("JCOCCL_TEST_INT", "3")
  assert _env.integer("JCOCCL_TEST_INT", 7, 0, 3) == 3


@pytest.mark.parametrize(
  "text, message",
  [
    ("abc", r"JCOCCL_TEST_INT must be an integer >= 1 and <= 4, got 'abc'"),
    ("1.5", r"must be an integer >= 1 and <= 4, got '1.5'"),
    ("0", r"must be an integer >= 1 and <= 4, got 0"),
    ("5", r"must be an integer >= 1 and <= 4, got 5"),
  ],
)
def test_integer_errors_name_the_variable_and_range(monkeypatch, text, message):
  monkeypatch.setenv("JCOCCL_TEST_INT", text)
  with pytest.raises(ValueError, match=message):
    _env.integer("JCOCCL_TEST_INT", 7, 1, 4)


def test_process_layout_from_the_environment(monkeypatch):
  for name in (D.ENV_COUNT, D.ENV_ID, D.ENV_ADDRESS):
    monkeypatch.delenv(name, raising=False)
  assert D.environment() is None
  monkeypatch.setenv(D.ENV_COUNT, "2")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID is not"):
    D.environment()
  monkeypatch.setenv(D.ENV_ID, "2")
  with pytest.raises(ValueError, match=r"JAX_PROCESS_ID must be an integer >= 0 and <= 1"):
    D.environment()
  monkeypatch.setenv(D.ENV_ID, "1")
  with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS must be host:port"):
    D.environment()
  monkeypatch.setenv(D.ENV_ADDRESS, "localhost:1234")
  assert D.environment() == {
    "coordinator_address": "localhost:1234",
    "num_processes": 2,
    "process_id": 1,
  }


def test_heartbeat_and_min_bytes(monkeypatch):
  monkeypatch.delenv("JCOCCL_HEARTBEAT_S", raising=False)
  assert D._heartbeat_s() == 20
  monkeypatch.setenv("JCOCCL_HEARTBEAT_S", "0")
  with pytest.raises(ValueError, match="JCOCCL_HEARTBEAT_S must be an integer >= 1"):
    D._heartbeat_s()
  monkeypatch.setenv("JCOCCL_MIN_BYTES", "-1")
  with pytest.raises(ValueError, match="JCOCCL_MIN_BYTES must be an integer >= 0"):
    jcoccl.set_config_defaults(reload=True)
