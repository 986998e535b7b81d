"""Qwen2 in Flax NNX: RMSNorm (float32), NeoX RoPE, grouped-query attention, SwiGLU MLP.

Matches Hugging Face ``Qwen2ForCausalLM`` (see ``from_hf``): q/k/v projections carry a bias,
o_proj does not, RoPE angles are computed in float32 as HF does, and the embeddings may be
tied to the lm_head or not. Heads and MLP columns may be a tensor-parallel slice.

Example:
  >>> cfg = QwenConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
  ...                  num_attention_heads=4, num_key_value_heads=2)
  >>> Qwen(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 8), jnp.int32)).shape
  (1, 8, 128)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.configs import models as presets
from models.family import Family
from models.layers import LOCAL, Comm, Dense, RMSNorm, causal_attention


@dataclasses.dataclass(frozen=True)
class QwenConfig:
  vocab_size: int = 256
  hidden_size: int = 128
  intermediate_size: int = 256
  num_hidden_layers: int = 4
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  tie_word_embeddings: bool = True
  head_dim: int | None = None

  @property
  def hd(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotates [batch, seq, heads, head_dim] by position, NeoX style (rotate_half, not interleaved).

  Angles are ``position * inv_freq`` in float32, ``inv_freq = 1 / theta^(arange(0, d, 2) / d)``.
  """
  d = x.shape[-1]
  inv_freq = 1.0 / (jnp.float32(theta) ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  freqs = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], -1)
  cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  rotated = jnp.concatenate([-x2, x1], -1)
  return (x * cos + rotated * sin).astype(x.dtype)


def _row(kernel: jax.Array, x: jax.Array, comm: Comm) -> jax.Array:
  """Row-parallel projection without bias: partial products summed over 'tensor'."""
  return comm.exit(jnp.einsum("...i,io->...o", x, kernel, precision=jax.lax.Precision.HIGHEST))


class Block(nnx.Module):
  """One Qwen2 decoder layer."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.hd
    self.head_dim, self.theta = hd, cfg.rope_theta
    self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
    self.q_proj = Dense(d, cfg.num_attention_heads * hd, rngs=rngs)
    self.k_proj = Dense(d, cfg.num_key_value_heads * hd, rngs=rngs)
    self.v_proj = Dense(d, cfg.num_key_value_heads * hd, rngs=rngs)
    self.o_proj = Dense(cfg.num_attention_heads * hd, d, bias=False, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
    self.gate_proj = Dense(d, cfg.intermediate_size, bias=False, rngs=rngs)
    self.up_proj = Dense(d, cfg.intermediate_size, bias=False, rngs=rngs)
    self.down_proj = Dense(cfg.intermediate_size, d, bias=False, rngs=rngs)

  def __call__(self, x: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    b, s, _ = x.shape
    h = comm.enter(self.input_layernorm(x))
    split = lambda t: t.reshape(b, s, -1, self.head_dim)
    q = rope(split(self.q_proj(h)), self.theta)
    k = rope(split(self.k_proj(h)), self.theta)
    x = x + _row(self.o_proj.kernel[...], causal_attention(q, k, split(self.v_proj(h))), comm)
    h = comm.enter(self.post_attention_layernorm(x))
    m = jax.nn.silu(self.gate_proj(h)) * self.up_proj(h)
    return x + _row(self.down_proj.kernel[...], m, comm)


class Qwen(nnx.Module):
  """Qwen2 causal LM; ``model(tokens)`` gives float32 logits [batch, seq, vocab]."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    v, d = cfg.vocab_size, cfg.hidden_size
    self.embed_tokens = nnx.Param(0.02 * jax.random.normal(rngs.params(), (v, d)))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(d, cfg.rms_norm_eps)
    self.lm_head = (
      None
      if cfg.tie_word_embeddings
      else nnx.Param(0.02 * jax.random.normal(rngs.params(), (d, v)))
    )

  def embed(self, tokens: jax.Array) -> jax.Array:
    return self.embed_tokens[...][tokens]

  def run_blocks(self, x: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    for block in self.blocks:
      x = block(x, comm)
    return x

  def head(self, x: jax.Array) -> jax.Array:
    w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
    return jnp.einsum("bsd,dv->bsv", self.norm(x), w, precision=jax.lax.Precision.HIGHEST)

  def __call__(self, tokens: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    return self.head(self.run_blocks(self.embed(tokens), comm))


# Which axis of each block parameter is split over 'tensor'; absent = replicated. Splitting
# q_proj and k/v_proj by contiguous heads keeps GQA's grouping when 'tensor' divides n_kv.
TENSOR_AXIS: dict[tuple[str, str], int] = {
  ("q_proj", "kernel"): 1,
  ("q_proj", "bias"): 0,
  ("k_proj", "kernel"): 1,
  ("k_proj", "bias"): 0,
  ("v_proj", "kernel"): 1,
  ("v_proj", "bias"): 0,
  ("gate_proj", "kernel"): 1,
  ("up_proj", "kernel"): 1,
  ("o_proj", "kernel"): 0,
  ("down_proj", "kernel"): 0,
}


def preset_config(size: str, vocab: int, seq_len: int) -> QwenConfig:
  """The ``--size`` preset (models/configs/models.py); RoPE has no position limit, so
  ``seq_len`` changes nothing."""
  del seq_len
  return QwenConfig(vocab_size=vocab, **presets.QWEN[size])


FAMILY = Family(
  name="qwen",
  model=Qwen,
  config=preset_config,
  sizes=tuple(presets.QWEN),
  layers_field="num_hidden_layers",
  heads=lambda c: (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
  tensor_axis=TENSOR_AXIS,
)


def config_from_hf(config: dict) -> QwenConfig:
  """Reads a ``Qwen2Config.to_dict()`` (rope theta top-level or under ``rope_parameters``)."""
  rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
  theta = config.get("rope_theta", rp.get("rope_theta", 10000.0))
  if rp.get("rope_type", "default") != "default":
    raise ValueError(f"config rope_type must be 'default', got {rp.get('rope_type')!r}")
  return QwenConfig(
    vocab_size=config["vocab_size"],
    hidden_size=config["hidden_size"],
    intermediate_size=config["intermediate_size"],
    num_hidden_layers=config["num_hidden_layers"],
    num_attention_heads=config["num_attention_heads"],
    num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
    rms_norm_eps=config.get("rms_norm_eps", 1e-6),
    rope_theta=float(theta),
    tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    head_dim=config.get("head_dim"),
  )


def from_hf(config: dict, state_dict: dict[str, np.ndarray]) -> Qwen:
  """Builds a Qwen from a HF ``Qwen2Config.to_dict()`` and a state dict of numpy arrays.

  Args:
    config: the transformers config dict.
    state_dict: HF names (``model.layers.0.self_attn.q_proj.weight``, ...) to arrays;
      ``nn.Linear`` weights are (out, in) and are transposed here.

  Returns:
    A ``Qwen`` whose logits match ``Qwen2ForCausalLM``.

  Example:
    >>> model = from_hf(hf.config.to_dict(), {k: v.numpy() for k, v in hf.state_dict().items()})
  """
  cfg = config_from_hf(config)
  sd = {k.removeprefix("model."): np.asarray(v, np.float32) for k, v in state_dict.items()}
  model = Qwen(cfg, rngs=nnx.Rngs(0))

  def get(name: str) -> jax.Array:
    if name not in sd:
      raise ValueError(f"state_dict is missing {name!r} (has {sorted(sd)[:8]}...)")
    return jnp.asarray(sd[name])

  model.embed_tokens[...] = get("embed_tokens.weight")
  model.norm.scale[...] = get("norm.weight")
  if model.lm_head is not None:
    model.lm_head[...] = get("lm_head.weight").T
  for i, blk in enumerate(model.blocks):
    p = f"layers.{i}."
    blk.input_layernorm.scale[...] = get(p + "input_layernorm.weight")
    blk.post_attention_layernorm.scale[...] = get(p + "post_attention_layernorm.weight")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      dense = getattr(blk, name)
      dense.kernel[...] = get(p + f"self_attn.{name}.weight").T
      if dense.bias is not None:
        dense.bias[...] = get(p + f"self_attn.{name}.bias")
    for name in ("gate_proj", "up_proj", "down_proj"):
      getattr(blk, name).kernel[...] = get(p + f"mlp.{name}.weight").T
  return model
