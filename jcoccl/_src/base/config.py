"""jcoccl's settings: one immutable :class:`Config`, read while a program is traced.

The settings that decide what a traced program does (the size threshold, how payloads are
gathered, the cost model behind ``algorithm="auto"``, the fused engine's timeout, whether
codecs may run their native kernels) live in
one frozen, hashable :class:`Config`. The collectives read :func:`current` while tracing
and bind it into each ``jcoccl_<op>`` primitive's params (``config=...``), so lowering and
the gradient passes see the same settings as the trace did.

The current config is a ``jax.make_user_context`` value: it is part of ``jax.jit``'s cache
key, so changing it (``with jcoccl.config(...)``, :func:`set_defaults`) retraces and
recompiles; a jitted function never keeps settings it saw earlier.

Environment variables give the process defaults and are parsed once, by
:func:`from_environment` (when this module is imported; :func:`set_defaults` with
``reload=True`` reads them again):

  JCOCCL_MIN_BYTES   default ``min_bytes`` (int >= 0; built in: 4 MiB)
  JCOCCL_GATHER      how payload rows are all-gathered: auto | all_gather | all_to_all
  JCOCCL_TIMEOUT_S   seconds a fused collective waits for its peers (see
                     :func:`jcoccl._src._env.seconds`; built in: 300)
  JCOCCL_COST_MODEL  a cost model JSON file (:mod:`jcoccl._src.base.cost_model`)
  JCOCCL_DISABLE_NATIVE  1: codecs run their jnp specification, never a native kernel,
                     and the fused engine is unavailable (``native=False``; 0 or unset:
                     native kernels where they exist)

Example:
  >>> with config(min_bytes=0):
  ...   current().min_bytes
  0
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jcoccl._src import _env

BUILTIN_MIN_BYTES = 4 * 1024 * 1024
# Said to whoever still sets the setting or its variable (both are gone).
NCCL_WAIT_REMOVED = (
  "the GPU fused engine never waits on the host for its NCCL work; a watchdog thread per "
  "communicator aborts a collective that waits longer than timeout_s (JCOCCL_TIMEOUT_S) "
  "for a lost peer, and the next call on that communicator raises the reason. Drop "
  "nccl_wait / JCOCCL_NCCL_WAIT."
)
GATHERS = ("auto", "all_gather", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Config:
  """Settings of the collectives (see the module docstring).

  Attributes:
    min_bytes: leaves (local bytes) under it go uncompressed.
    gather: "all_gather" (XLA's all-gather) or "all_to_all" (the row broadcast to every
      rank through an all-to-all).
    timeout_s: seconds a fused collective waits for its peers, in (0, 1e8].
    cost_model: the :class:`jcoccl._src.base.cost_model.CostModels` behind ``algorithm="auto"``,
      or None: the platform's default model (one_shot or two_shot, never exact).
    native: False: jcoccl's native modules are not used (codecs run their jnp
      specification; no fused engine).
  """

  min_bytes: int = BUILTIN_MIN_BYTES
  gather: str = "all_gather"
  timeout_s: float = _env.DEFAULT_TIMEOUT_S
  cost_model: Any = None
  native: bool = True

  def __post_init__(self):
    m = self.min_bytes
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
      raise ValueError(f"config min_bytes must be a non-negative int, got {m!r}")
    if self.gather not in GATHERS:
      raise ValueError(f"config gather must be one of {GATHERS}, got {self.gather!r}")
    if self.gather == "auto":
      object.__setattr__(self, "gather", "all_gather")
    t = self.timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
      raise ValueError(f"config timeout_s must be a positive number of seconds, got {t!r}")
    object.__setattr__(self, "timeout_s", min(float(t), _env.MAX_TIMEOUT_S))
    if not isinstance(self.native, (bool, np.bool_)):
      raise ValueError(f"config native must be a bool, got {self.native!r}")
    object.__setattr__(self, "native", bool(self.native))
    from jcoccl._src.base import cost_model as cm

    if self.cost_model is not None and not isinstance(self.cost_model, cm.CostModels):
      object.__setattr__(self, "cost_model", cm.CostModels.of(self.cost_model))

  def __str__(self) -> str:
    model = "default" if self.cost_model is None else self.cost_model.name()
    return (
      f"config(min_bytes={self.min_bytes} gather={self.gather} timeout_s={self.timeout_s:g} "
      f"cost_model={model}"
      f"{'' if self.native else ' native=False'})"
    )

  __repr__ = __str__


FIELDS = tuple(f.name for f in dataclasses.fields(Config))
# None until the environment has been read: the jit key then holds the defaults themselves.
_CONTEXT = jax.make_user_context(None)
_env_error: ValueError | None = None


def from_environment() -> Config:
  """The defaults that the ``JCOCCL_*`` environment variables give, read now.

  Raises:
    ValueError: a variable holds a bad value (the message names it).
  """
  from jcoccl._src.base import cost_model as cm

  gather = os.environ.get("JCOCCL_GATHER", "") or "auto"
  if gather not in GATHERS:
    raise ValueError(f"JCOCCL_GATHER must be one of {GATHERS}, got {gather!r}")
  path = os.environ.get("JCOCCL_COST_MODEL", "")
  disable = _flag("JCOCCL_DISABLE_NATIVE", "0")
  if "JCOCCL_NCCL_WAIT" in os.environ:
    warnings.warn(f"JCOCCL_NCCL_WAIT is ignored: {NCCL_WAIT_REMOVED}", stacklevel=2)
  return Config(
    min_bytes=_env.integer("JCOCCL_MIN_BYTES", BUILTIN_MIN_BYTES, 0),
    gather=gather,
    timeout_s=_env.seconds("JCOCCL_TIMEOUT_S", _env.DEFAULT_TIMEOUT_S),
    cost_model=cm.read(path) if path else None,
    native=not disable,
  )


def _flag(name: str, default: str) -> bool:
  text = os.environ.get(name, "") or default
  if text not in ("0", "1"):
    raise ValueError(f"{name} must be 0 or 1, got {text!r}")
  return text == "1"


def _load_defaults() -> None:
  global _env_error
  try:
    _CONTEXT.set_global(from_environment())
    _env_error = None
  except ValueError as e:
    _env_error = e


def current() -> Config:
  """The config in effect here: the innermost ``with config(...)``, else the defaults.

  Raises:
    ValueError: the defaults come from a bad environment variable (named).
  """
  value = _CONTEXT.value
  if value is None:
    _load_defaults()
    if _env_error is not None:
      raise _env_error
    value = _CONTEXT.value
  return value


def defaults() -> Config:
  """The process-wide defaults (what :func:`current` gives outside ``with config``)."""
  if _CONTEXT.get_global() is None:
    current()
  return _CONTEXT.get_global()


def _replaced(base: Config, overrides: dict[str, Any]) -> Config:
  if "nccl_wait" in overrides:
    raise TypeError(f"config nccl_wait was removed: {NCCL_WAIT_REMOVED}")
  unknown = sorted(set(overrides) - set(FIELDS))
  if unknown:
    raise TypeError(f"config got unknown settings {unknown}; accepted: {', '.join(FIELDS)}")
  return dataclasses.replace(base, **overrides)


@contextlib.contextmanager
def config(**settings: Any) -> Iterator[Config]:
  """Runs the block with ``settings`` replacing those of the current config.

  Programs traced inside the block bind the resulting config into their primitives; a
  jitted function called inside and outside is traced (and compiled) once for each.

  Args:
    **settings: any of ``min_bytes``, ``gather``, ``timeout_s``, ``cost_model``,
      ``native``.

  Yields:
    The config in effect inside the block.

  Raises:
    TypeError: an unknown setting. ValueError: a bad value (the message names it).

  Example:
    >>> import jcoccl
    >>> with jcoccl.config(min_bytes=0, gather="all_to_all") as c:
    ...   c.gather
    'all_to_all'
  """
  new = _replaced(current(), settings)
  with _CONTEXT(new):
    yield new


@contextlib.contextmanager
def using(cfg: Config) -> Iterator[None]:
  """Runs the block under ``cfg`` exactly (a primitive's captured config)."""
  if _CONTEXT.value is cfg:
    yield
    return
  with _CONTEXT(cfg):
    yield


def set_defaults(*, reload: bool = False, **settings: Any) -> Config:
  """Changes the process-wide defaults (outside any ``with jcoccl.config``).

  Args:
    reload: start again from the environment variables (read now).
    **settings: as :func:`config`'s.

  Returns:
    The new defaults.

  Example:
    >>> import jcoccl
    >>> jcoccl.set_config_defaults(min_bytes=0).min_bytes
    0
    >>> _ = jcoccl.set_config_defaults(reload=True)
  """
  base = from_environment() if reload else defaults()
  new = _replaced(base, settings)
  _CONTEXT.set_global(new)
  return new


# Read when jcoccl is imported, not at the first trace: the defaults are part of jit's key,
# and filling them in while the first program traces would make its next call miss the
# cache and trace again. A bad variable is raised at the first use (current()).
_load_defaults()
