"""Writes tests/goldens/*.npz: tiny random-weight HF GPT-2 / Qwen2 models and their logits.

Runs in a separate Python 3.11 venv with CPU torch and transformers (the test env has neither):

  python3.11 -m venv .venv-hf
  .venv-hf/bin/pip install torch==2.13.0 numpy && .venv-hf/bin/pip install transformers
  .venv-hf/bin/python tools/make_goldens.py

Each file holds ``config`` (JSON of ``config.to_dict()``), ``tokens`` (int32 [2, 16]),
``logits`` (float32 [2, 16, vocab]) and every state-dict entry under ``sd/<hf name>``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "goldens"


def _save(name: str, model: torch.nn.Module, vocab: int) -> None:
  model.eval()
  gen = torch.Generator().manual_seed(1)
  tokens = torch.randint(0, vocab, (2, 16), generator=gen)
  with torch.no_grad():
    logits = model(tokens).logits.float().numpy()
  # A tied lm_head is the embedding again: leave it out (from_hf must not need it).
  tied = model.config.tie_word_embeddings
  arrays = {
    "sd/" + k: v.detach().float().numpy()
    for k, v in model.state_dict().items()
    if not (tied and k == "lm_head.weight")
  }
  config = json.dumps(model.config.to_dict(), default=str)
  np.savez_compressed(
    OUT / f"{name}.npz",
    config=np.array(config),
    tokens=tokens.int().numpy(),
    logits=logits,
    **arrays,
  )
  print(f"{name}: {sum(a.size for a in arrays.values())} params, logits {logits.shape}")


def _randomize(model: torch.nn.Module) -> None:
  """Norm weights and biases away from 1/0, so that loaders mixing them up fail."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name or "ln" in name else 0.0))


def main() -> None:
  OUT.mkdir(parents=True, exist_ok=True)
  torch.manual_seed(0)
  gpt = transformers.GPT2Config(
    vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager"
  )
  m = transformers.GPT2LMHeadModel(gpt)
  _randomize(m)
  _save("gpt2", m, 128)
  for tied in (True, False):
    cfg = transformers.Qwen2Config(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=64,
      rope_theta=5000.0,
      rms_norm_eps=1e-5,
      tie_word_embeddings=tied,
      attn_implementation="eager",
    )
    m = transformers.Qwen2ForCausalLM(cfg)
    _randomize(m)
    _save("qwen2_tied" if tied else "qwen2_untied", m, 128)


if __name__ == "__main__":
  main()
