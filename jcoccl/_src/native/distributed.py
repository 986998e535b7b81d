"""Joining JAX's multi-controller runtime from whatever started the processes.

jcoccl's ops need nothing of their own across processes: they run inside JAX's runtime
(``jax.distributed``: gloo collectives between CPU processes, NCCL between GPU processes).
:func:`initialize` only gathers the process layout from the environment and calls
``jax.distributed.initialize`` with it, so that one program runs unchanged under
``python -m jcoccl.launch``, under SLURM or Open MPI (JAX detects those itself), or alone.

Environment (set by ``python -m jcoccl.launch``, or by hand on a cluster):
  JAX_COORDINATOR_ADDRESS  host:port of process 0's coordination service (JAX reads it too).
  JAX_NUM_PROCESSES        number of processes.
  JAX_PROCESS_ID           this process's index, 0 .. JAX_NUM_PROCESSES - 1.
  JCOCCL_HEARTBEAT_S       seconds without a heartbeat after which JAX's coordination service
                           declares a process dead and stops the others (default 20; JAX's
                           own default is 100).
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jcoccl._src import _env

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_COUNT = "JAX_NUM_PROCESSES"
ENV_ID = "JAX_PROCESS_ID"
_CLUSTER_MARKERS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")
_initialized = False


def _heartbeat_s() -> int:
  return _env.integer("JCOCCL_HEARTBEAT_S", 20, 1)


def environment() -> dict[str, int | str] | None:
  """The process layout given by JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.

  Returns:
    ``{"coordinator_address", "num_processes", "process_id"}``, or None when
    JAX_NUM_PROCESSES is unset.

  Raises:
    ValueError: a variable is missing or malformed (the message names it).
  """
  count = _env.integer(ENV_COUNT, None, 1)
  if count is None:
    return None
  pid = _env.integer(ENV_ID, None, 0, count - 1)
  if pid is None:
    raise ValueError(f"{ENV_COUNT} is set but {ENV_ID} is not: set both (and {ENV_ADDRESS})")
  address = os.environ.get(ENV_ADDRESS, "")
  if count > 1 and ":" not in address:
    raise ValueError(f"{ENV_ADDRESS} must be host:port of process 0, got {address!r}")
  return {"coordinator_address": address, "num_processes": count, "process_id": pid}


def initialize() -> bool:
  """Joins the multi-process runtime described by the environment, if any.

  Call it first thing, before any other JAX call. Uses JAX_NUM_PROCESSES / JAX_PROCESS_ID /
  JAX_COORDINATOR_ADDRESS when set (``python -m jcoccl.launch`` sets them), else lets JAX
  detect SLURM or Open MPI, else does nothing (one process). CPU processes talk through
  gloo. Calling it again is a no-op.

  Returns:
    True if this program now runs as one of several processes.

  Raises:
    ValueError: the environment describes the layout inconsistently.

  Example:
    >>> import jcoccl
    >>> jcoccl.distributed.initialize()   # alone: nothing to join
    False
  """
  global _initialized
  if _initialized:
    return jax.process_count() > 1
  layout = environment()
  cluster = layout is None and any(m in os.environ for m in _CLUSTER_MARKERS)
  if (layout is None or layout["num_processes"] == 1) and not cluster:
    return False
  # Only the CPU client reads this; GPU processes use NCCL through their own plugin.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs: dict[str, Any] = dict(layout or {})
  jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=_heartbeat_s())
  _initialized = True
  return jax.process_count() > 1
