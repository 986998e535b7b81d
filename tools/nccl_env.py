"""The environment of one NCCL rank among several on the one GPU, each seen as a node of its
own over NCCL's socket transport (tools/gpu_collectives.py launch and
tools/gpu_nccl_interposer.py).

Example:
  >>> rank_env(1)["NCCL_HOSTID"]
  'jcoccl-rank-1'
"""

from __future__ import annotations


def rank_env(rank: int) -> dict[str, str]:
  """The variables that make process ``rank`` a separate node on the loopback socket link.

  Args:
    rank: the process's rank.

  Returns:
    ``NCCL_HOSTID`` distinct per rank (NCCL would otherwise see one host and refuse two
    ranks on one GPU, or share memory between them), ``NCCL_SOCKET_IFNAME=lo`` and
    ``NCCL_IB_DISABLE=1`` (the socket transport over loopback), and
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (each process takes GPU memory as it needs it,
    so that several fit on the one GPU).
  """
  return {
    "NCCL_HOSTID": f"jcoccl-rank-{rank}",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
  }
