"""Model presets for ``python -m models.train --size``: name -> config keyword arguments.

``wide`` is for the multi-process benchmark (benchmarks/train_e2e.py): few layers of large
matrices, so that per token of compute there are many gradient bytes to send, and the exact
step over 2 processes on a 1 Gbit/s link spends most of its time on the network.
"""

GPT = {
  "tiny": dict(n_positions=64, n_embd=32, n_layer=2, n_head=4),
  "small": dict(n_positions=128, n_embd=128, n_layer=4, n_head=4),
  "base": dict(n_positions=256, n_embd=256, n_layer=8, n_head=8),
  "wide": dict(n_positions=64, n_embd=1024, n_layer=4, n_head=16),
}

QWEN = {
  "tiny": dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
  ),
  "small": dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
  ),
  "base": dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    rope_theta=10000.0,
  ),
  "wide": dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    rope_theta=10000.0,
  ),
}

# Training arguments of a run that takes seconds: the tiny model on short sequences, for
# tests and smoke runs (``python -m models.train *TINY_RUN``; callers add their own
# warmup, evaluation and output flags).
TINY_RUN = [
  "--size",
  "tiny",
  "--batch",
  "8",
  "--seq-len",
  "32",
  "--micro",
  "2",
  "--lr",
  "1e-2",
  "--max-chars",
  "200000",
  # Tests and the accuracy study measure compression itself: auto stays uncalibrated.
  "--no-calibrate",
]
