"""The cost model in use: the current config's table, else the platform default.

Kept apart from :mod:`jcoccl._src.base.cost_model` (the model itself, which knows nothing of
the config) so that imports point one way: config -> cost_model, and this module ->
both.

Example:
  >>> active(axes=("data",)).source  # doctest: +SKIP
  'fit: 4 CPU processes, 10gbit loopback'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jcoccl._src.base import config
from jcoccl._src.base.cost_model import DEFAULTS, CostModel, CostModels, read


def set_model(model: CostModels | CostModel | None) -> None:
  """Makes ``model`` the process default behind algorithm="auto" (None: the platform's).

  Shorthand for ``jcoccl.set_config_defaults(cost_model=model)``. Programs are traced
  again when it changes (it is part of the config, which is part of jit's cache key);
  ``with jcoccl.config(cost_model=...)`` sets one for a block.

  Example:
    >>> set_model(CostModel(1e-4, 1.2e8, 2e9, "my 1 Gbit/s cluster"))
    >>> set_model(None)
  """
  if model is not None and not isinstance(model, (CostModel, CostModels)):
    raise TypeError(f"model must be a CostModel, CostModels or None, got {type(model).__name__}")
  config.set_defaults(cost_model=model)


def load(path: str) -> CostModels:
  """Reads a model file (``bench calibrate``, ``bench collectives --fit-out``) and makes
  it the process default.

  Raises:
    ValueError: the file is not such a model (the message names the file and key).
  """
  models = read(path)
  set_model(models)
  return models


def active(
  platform: str | None = None, axes: Sequence[str] = (), op: str = "all_reduce", codec: Any = None
) -> CostModel:
  """The model in use for ``op`` over ``axes``: the current config's (with ``codec``'s
  measured throughput where the table has it), else the platform's default."""
  table = config.current().cost_model
  found = None if table is None else table.get(tuple(axes), op, codec)
  if found is not None:
    return found
  if platform is None:
    import jax

    platform = jax.default_backend()
  return DEFAULTS["cpu" if platform == "cpu" else "gpu"]


def choose_all_reduce(nbytes: int, n: int, ratio: float) -> str:
  """The cheaper of one_shot and two_shot under the platform's default cost model
  (:mod:`jcoccl._src.base.cost_model`), by time alone; algorithm="auto" without a calibration
  also keeps within the exact op's bytes (:func:`jcoccl._src.ops.all_reduce_auto.choose`).

  Example:
    >>> choose_all_reduce(64 * 1024, 8, 0.26), choose_all_reduce(64 << 20, 8, 0.26)
    ('one_shot', 'two_shot')
  """
  return active().choose(nbytes, n, ratio)
