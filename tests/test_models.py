"""GPT-2 and Qwen2 match Hugging Face transformers on random weights (goldens from
tools/make_goldens.py, loaded with numpy only)."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import gpt, qwen

GOLDENS = pathlib.Path(__file__).parent / "goldens"
CASES = [("gpt2", gpt), ("qwen2_tied", qwen), ("qwen2_untied", qwen)]


def _load(name: str) -> tuple[dict, dict, np.ndarray, np.ndarray]:
  with np.load(GOLDENS / f"{name}.npz") as f:
    sd = {k[3:]: f[k] for k in f.files if k.startswith("sd/")}
    return json.loads(str(f["config"])), sd, f["tokens"], f["logits"]


@nnx.jit
def _forward(model, tokens):
  """The model's logits as one compiled program (called eagerly, each op compiles alone)."""
  return model(tokens)


@pytest.mark.parametrize("name,module", CASES)
def test_logits_match_hf(name, module):
  config, sd, tokens, want = _load(name)
  model = module.from_hf(config, sd)
  got = np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32)))
  assert got.dtype == np.float32 and got.shape == want.shape
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name,module", CASES)
def test_prefix_is_causal(name, module):
  """Logits at position t depend only on tokens <= t."""
  config, sd, tokens, want = _load(name)
  model = module.from_hf(config, sd)
  got = np.asarray(_forward(model, jnp.asarray(tokens[:, :7], jnp.int32)))
  np.testing.assert_allclose(got, want[:, :7], atol=1e-4, rtol=0)


def test_qwen_tied_and_untied_differ():
  config, sd, _, _ = _load("qwen2_untied")
  model = qwen.from_hf(config, sd)
  assert model.lm_head is not None
  assert not np.allclose(np.asarray(model.lm_head[...]).T, sd["model.embed_tokens.weight"])
  config_t, sd_t, _, _ = _load("qwen2_tied")
  assert qwen.from_hf(config_t, sd_t).lm_head is None
  assert qwen.config_from_hf(config).rope_theta == 5000.0


def test_missing_weight_names_it():
  config, sd, _, _ = _load("gpt2")
  del sd["transformer.h.1.mlp.c_fc.weight"]
  with pytest.raises(ValueError, match="h.1.mlp.c_fc.weight"):
    gpt.from_hf(config, sd)


def test_bad_activation_rejected():
  config, sd, _, _ = _load("gpt2")
  with pytest.raises(ValueError, match="activation_function"):
    gpt.from_hf({**config, "activation_function": "relu"}, sd)


def test_sizes():
  assert sum(p.stat().st_size for p in GOLDENS.glob("*.npz")) < 1_100_000
  m = gpt.GPT(
    gpt.GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2), rngs=nnx.Rngs(0)
  )
  assert _forward(m, jnp.zeros((1, 5), jnp.int32)).shape == (1, 5, 64)
