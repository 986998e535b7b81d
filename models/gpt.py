"""GPT-2 in Flax NNX: learned positions, pre-LayerNorm (eps 1e-5), tanh GELU, tied lm_head.

Matches Hugging Face ``GPT2LMHeadModel`` (see ``from_hf``). The attention and MLP
projections are Megatron column/row pairs, so the same code runs tensor-parallel on
the local shard inside ``jax.shard_map`` (``models.parallel``).

Example:
  >>> cfg = GPTConfig(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4)
  >>> model = GPT(cfg, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((1, 8), jnp.int32)).shape
  (1, 8, 128)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.configs import models as presets
from models.family import Family
from models.layers import LOCAL, Comm, Dense, LayerNorm, causal_attention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256
  n_positions: int = 256
  n_embd: int = 128
  n_layer: int = 4
  n_head: int = 4
  layer_norm_epsilon: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head


def _row(dense: Dense, x: jax.Array, comm: Comm) -> jax.Array:
  """Row-parallel projection: partial products summed over 'tensor', then the bias once."""
  y = jnp.einsum("...i,io->...o", x, dense.kernel[...], precision=jax.lax.Precision.HIGHEST)
  return comm.exit(y) + dense.bias[...]


class Block(nnx.Module):
  """One transformer block; heads and MLP columns may be a tensor-parallel slice."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    d, out_std = cfg.n_embd, 0.02 / math.sqrt(2 * cfg.n_layer)
    self.head_dim = cfg.head_dim
    self.ln_1 = LayerNorm(d, cfg.layer_norm_epsilon)
    self.q = Dense(d, d, rngs=rngs)
    self.k = Dense(d, d, rngs=rngs)
    self.v = Dense(d, d, rngs=rngs)
    self.c_proj = Dense(d, d, std=out_std, rngs=rngs)
    self.ln_2 = LayerNorm(d, cfg.layer_norm_epsilon)
    self.c_fc = Dense(d, 4 * d, rngs=rngs)
    self.mlp_proj = Dense(4 * d, d, std=out_std, rngs=rngs)

  def __call__(self, x: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    b, s, _ = x.shape
    h = comm.enter(self.ln_1(x))
    split = lambda t: t.reshape(b, s, -1, self.head_dim)
    a = causal_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
    x = x + _row(self.c_proj, a, comm)
    h = comm.enter(self.ln_2(x))
    return x + _row(self.mlp_proj, jax.nn.gelu(self.c_fc(h), approximate=True), comm)


class GPT(nnx.Module):
  """GPT-2 language model; ``model(tokens)`` gives float32 logits [batch, seq, vocab]."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wte = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.n_embd)))
    self.wpe = nnx.Param(0.01 * jax.random.normal(rngs.params(), (cfg.n_positions, cfg.n_embd)))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
    self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)

  def embed(self, tokens: jax.Array) -> jax.Array:
    return self.wte[...][tokens] + self.wpe[...][: tokens.shape[1]]

  def run_blocks(self, x: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    for block in self.blocks:
      x = block(x, comm)
    return x

  def head(self, x: jax.Array) -> jax.Array:
    return jnp.einsum(
      "bsd,vd->bsv", self.ln_f(x), self.wte[...], precision=jax.lax.Precision.HIGHEST
    )

  def __call__(self, tokens: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    return self.head(self.run_blocks(self.embed(tokens), comm))


# Which axis of each block parameter is split over 'tensor' (column-parallel q/k/v/c_fc split
# their outputs, row-parallel c_proj/mlp_proj their inputs); absent = replicated.
TENSOR_AXIS: dict[tuple[str, str], int] = {
  ("q", "kernel"): 1,
  ("q", "bias"): 0,
  ("k", "kernel"): 1,
  ("k", "bias"): 0,
  ("v", "kernel"): 1,
  ("v", "bias"): 0,
  ("c_fc", "kernel"): 1,
  ("c_fc", "bias"): 0,
  ("c_proj", "kernel"): 0,
  ("mlp_proj", "kernel"): 0,
}


def preset_config(size: str, vocab: int, seq_len: int) -> GPTConfig:
  """The ``--size`` preset (models/configs/models.py), its positions covering ``seq_len``."""
  kw = dict(presets.GPT[size])
  kw["n_positions"] = max(kw["n_positions"], seq_len)
  return GPTConfig(vocab_size=vocab, **kw)


FAMILY = Family(
  name="gpt",
  model=GPT,
  config=preset_config,
  sizes=tuple(presets.GPT),
  layers_field="n_layer",
  heads=lambda c: (c.n_head,),
  tensor_axis=TENSOR_AXIS,
)


def config_from_hf(config: dict) -> GPTConfig:
  """Reads a ``GPT2Config.to_dict()``."""
  act = config.get("activation_function", "gelu_new")
  if act not in ("gelu_new", "gelu_pytorch_tanh"):
    raise ValueError(
      f"config['activation_function'] must be 'gelu_new' or "
      f"'gelu_pytorch_tanh' (tanh GELU), got {act!r}"
    )
  return GPTConfig(
    vocab_size=config["vocab_size"],
    n_positions=config["n_positions"],
    n_embd=config["n_embd"],
    n_layer=config["n_layer"],
    n_head=config["n_head"],
    layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
  )


def from_hf(config: dict, state_dict: dict[str, np.ndarray]) -> GPT:
  """Builds a GPT from a HF ``GPT2Config.to_dict()`` and a state dict of numpy arrays.

  Args:
    config: the transformers config dict.
    state_dict: HF parameter names (with or without the ``transformer.`` prefix) to arrays.

  Returns:
    A ``GPT`` whose logits match ``GPT2LMHeadModel``.

  Example:
    >>> model = from_hf(hf.config.to_dict(), {k: v.numpy() for k, v in hf.state_dict().items()})
  """
  cfg = config_from_hf(config)
  sd = {k.removeprefix("transformer."): np.asarray(v, np.float32) for k, v in state_dict.items()}
  model = GPT(cfg, rngs=nnx.Rngs(0))
  get = lambda name: jnp.asarray(_need(sd, name))
  model.wte[...] = get("wte.weight")
  model.wpe[...] = get("wpe.weight")
  model.ln_f.scale[...], model.ln_f.bias[...] = get("ln_f.weight"), get("ln_f.bias")
  d = cfg.n_embd
  for i, blk in enumerate(model.blocks):
    p = f"h.{i}."
    w, bias = get(p + "attn.c_attn.weight"), get(p + "attn.c_attn.bias")
    for j, dense in enumerate((blk.q, blk.k, blk.v)):
      dense.kernel[...], dense.bias[...] = w[:, j * d : (j + 1) * d], bias[j * d : (j + 1) * d]
    for ours, theirs in ((blk.ln_1, "ln_1"), (blk.ln_2, "ln_2")):
      ours.scale[...], ours.bias[...] = get(p + theirs + ".weight"), get(p + theirs + ".bias")
    for ours, theirs in (
      (blk.c_proj, "attn.c_proj"),
      (blk.c_fc, "mlp.c_fc"),
      (blk.mlp_proj, "mlp.c_proj"),
    ):
      ours.kernel[...], ours.bias[...] = get(p + theirs + ".weight"), get(p + theirs + ".bias")
  return model


def _need(sd: dict[str, np.ndarray], name: str) -> np.ndarray:
  if name not in sd:
    raise ValueError(f"state_dict is missing {name!r} (has {sorted(sd)[:8]}...)")
  return sd[name]
