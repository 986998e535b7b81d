"""A small decoder-only transformer LM in Flax NNX, its kernels sharded over ``model``.

Written as any GSPMD program is: each kernel names the mesh axes of its dimensions
(``nnx.with_partitioning``) and the compiler inserts the collectives. Nothing here knows
about jcoccl.

Example:
  >>> cfg = ModelConfig(vocab_size=88)
  >>> model = TransformerLM(cfg, nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 88)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  seq_len: int = 64
  dtype: str = "float32"  # parameters and activations; "bfloat16" for mixed precision
  fsdp: bool = False  # kernels' first dimension sharded over fsdp_axis too (ZeRO-3 style)
  fsdp_axis: str = "data"  # 'fsdp' for HSDP (mesh replica x fsdp x model)


def _sharded(cfg: ModelConfig, *names: str | None) -> nnx.Initializer:
  """A kernel initializer annotated with its dimensions' mesh axes."""
  if cfg.fsdp and names[0] is None:
    names = (cfg.fsdp_axis, *names[1:])
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
  dtype = jnp.dtype(cfg.dtype)
  return nnx.Linear(
    n_in,
    n_out,
    use_bias=False,
    kernel_init=_sharded(cfg, *names),
    dtype=dtype,
    param_dtype=dtype,
    rngs=rngs,
  )


class Block(nnx.Module):
  """Pre-norm attention and MLP; q/k/v and the MLP's first kernel column-sharded over
  'model', the output kernels row-sharded (Megatron's layout)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.ln1 = nnx.LayerNorm(d, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.qkv = _linear(cfg, d, 3 * d, (None, "model"), rngs)
    self.out = _linear(cfg, d, d, ("model", None), rngs)
    self.ln2 = nnx.LayerNorm(d, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.up = _linear(cfg, d, 4 * d, (None, "model"), rngs)
    self.down = _linear(cfg, 4 * d, d, ("model", None), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h = self.cfg.n_heads
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = nnx.dot_product_attention(q, k, v, mask=mask[None, None])
    x = x + self.out(att.reshape(b, t, d))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class TransformerLM(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "model")),
      dtype=dtype,
      param_dtype=dtype,
      rngs=rngs,
    )
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model), dtype) * 0.02)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.head = _linear(cfg, cfg.d_model, cfg.vocab_size, (None, "model"), rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x)).astype(jnp.float32)
