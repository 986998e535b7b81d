"""What the training code needs to know about a model family: each model module declares one.

``models.gpt.FAMILY`` and ``models.qwen.FAMILY`` say how to build the model from a size
preset, which config field counts its layers (split over 'pipe'), which sizes 'tensor' must
divide, and which axis of each block parameter 'tensor' splits. ``models.registry`` keys
them by name (``--model``).

Example:
  >>> from models import gpt
  >>> model = gpt.FAMILY.build("tiny", vocab=65, seq_len=32, seed=0)
  >>> gpt.FAMILY.layers(model.cfg)
  2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family.

  Attributes:
    name: the ``--model`` name.
    model: the ``nnx.Module`` class, built as ``model(config, rngs=...)``.
    config: ``config(size, vocab, seq_len)`` -> the model config of a size preset whose
      vocabulary is ``vocab`` and whose positions cover ``seq_len``.
    sizes: the size preset names (``--size``).
    layers_field: the config field that counts the blocks (split over 'pipe').
    heads: ``heads(config)`` -> the sizes that the 'tensor' axis must divide.
    tensor_axis: (module, parameter) name -> the axis of that block parameter split over
      'tensor' (absent: replicated).
  """

  name: str
  model: type
  config: Callable[[str, int, int], Any]
  sizes: tuple[str, ...]
  layers_field: str
  heads: Callable[[Any], tuple[int, ...]]
  tensor_axis: Mapping[tuple[str, str], int]

  def layers(self, config: Any) -> int:
    """The number of blocks of ``config``."""
    return int(getattr(config, self.layers_field))

  def with_layers(self, config: Any, n: int) -> Any:
    """``config`` with ``n`` blocks (one pipeline stage's share)."""
    return dataclasses.replace(config, **{self.layers_field: n})

  def build(self, size: str, *, vocab: int, seq_len: int, seed: int) -> nnx.Module:
    """A freshly initialised model of preset ``size``."""
    return self.model(self.config(size, vocab, seq_len), rngs=nnx.Rngs(seed))
