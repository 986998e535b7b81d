"""Shared helpers for the model tests (test_parallel, test_zero, test_mixed_precision): tiny
GPT and Qwen models and token batches over one small vocabulary.

Two layers by default: one per stage on the pipe-2 meshes. Compiling the unrolled pipeline
is most of these tests' time and grows with the layers; the 4-layer cases keep several
layers per stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import gpt, qwen

VOCAB = 64


def tiny_gpt(layers: int = 2) -> gpt.GPT:
  """A GPT-2 of ``layers`` blocks, width 32, 4 heads (weights from seed 0)."""
  return gpt.GPT(
    gpt.GPTConfig(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=layers, n_head=4),
    rngs=nnx.Rngs(0),
  )


def tiny_qwen(tie: bool = False, layers: int = 2) -> qwen.Qwen:
  """A Qwen2 of ``layers`` blocks, 4 query and 2 key/value heads (weights from seed 1)."""
  return qwen.Qwen(
    qwen.QwenConfig(
      vocab_size=VOCAB,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=layers,
      num_attention_heads=4,
      num_key_value_heads=2,
      rope_theta=5000.0,
      tie_word_embeddings=tie,
    ),
    rngs=nnx.Rngs(1),
  )


def batch(n: int = 8, s: int = 8, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """``n`` random token rows of length ``s``: (inputs, next-token targets)."""
  tok = np.random.default_rng(seed).integers(0, VOCAB, (n, s + 1))
  return jnp.asarray(tok[:, :-1], jnp.int32), jnp.asarray(tok[:, 1:], jnp.int32)
