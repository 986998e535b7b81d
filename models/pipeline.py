"""GPipe micro-batch schedule over the 'pipe' mesh axis, differentiable end to end.

Stage ``s`` holds a contiguous slice of the layers. At tick ``t`` it runs micro-batch
``t - s``: stage 0 reads it from the inputs, later stages receive it from stage ``s - 1``
over a ppermute. ``jax.grad`` of a loss on the outputs sends cotangents back along the
inverse permutation (the transpose of ppermute), which is the backward half of GPipe.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Permute = Callable[[jax.Array, list[tuple[int, int]]], jax.Array]


def gpipe(
  stage_fn: Callable[[jax.Array], jax.Array],
  inputs: jax.Array,
  *,
  axis_name: str,
  n_stages: int,
  permute: Permute,
) -> jax.Array:
  """Runs ``inputs`` through ``n_stages`` pipeline stages, one micro-batch per tick.

  Call inside ``jax.shard_map`` over ``axis_name``.

  Args:
    stage_fn: this stage's layers, [micro_batch, ...] -> same shape.
    inputs: [n_micro, micro_batch, ...]; only stage 0's copy is read.
    axis_name: the pipeline mesh axis.
    n_stages: the size of ``axis_name``.
    permute: ``permute(x, perm)`` sends ``x`` along ``perm`` over ``axis_name`` (a jcoccl
      ppermute with the policy's compressor).

  Returns:
    [n_micro, micro_batch, ...]: the last stage's outputs; other stages hold values that
    must not reach the loss (mask them with ``is_last_stage``).

  Example:
    >>> out = gpipe(lambda x: model.run_blocks(x), x_micro, axis_name="pipe", n_stages=2,
    ...             permute=lambda x, p: jcoccl.ppermute(x, "pipe", p))
  """
  n_micro = inputs.shape[0]
  if n_stages == 1:
    return jnp.stack([stage_fn(inputs[i]) for i in range(n_micro)])
  stage = lax.axis_index(axis_name)
  forward = [(i, i + 1) for i in range(n_stages - 1)]
  carry = jnp.zeros_like(inputs[0])
  outputs = []
  last_tick = n_micro + n_stages - 2
  for t in range(last_tick + 1):
    x = jnp.where(stage == 0, inputs[min(t, n_micro - 1)], carry)
    y = stage_fn(x)
    if t >= n_stages - 1:  # the last stage just finished micro-batch t - (n_stages - 1)
      outputs.append(y)
    if t < last_tick:
      carry = permute(y, forward)
  return jnp.stack(outputs)


def is_last_stage(axis_name: str, n_stages: int) -> jax.Array:
  """True on the pipeline stage that holds the real outputs."""
  if n_stages == 1:
    return jnp.bool_(True)
  return lax.axis_index(axis_name) == n_stages - 1
