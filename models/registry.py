"""The model families by name (``--model``): each model module declares its own entry.

Example:
  >>> from models import registry
  >>> registry.get("qwen").layers_field
  'num_hidden_layers'
"""

from __future__ import annotations

from flax import nnx

from models import gpt, qwen
from models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, qwen.FAMILY)}
# Every size preset name, in the order the presets list them.
SIZES: tuple[str, ...] = tuple(dict.fromkeys(s for f in FAMILIES.values() for s in f.sizes))


def get(name: str) -> Family:
  """The family called ``name``.

  Raises:
    ValueError: no such family; the message lists the known ones.
  """
  if name not in FAMILIES:
    raise ValueError(f"model must be one of {sorted(FAMILIES)}, got {name!r}")
  return FAMILIES[name]


def family_of(model: nnx.Module) -> Family:
  """The family whose model class ``model`` is an instance of.

  Raises:
    TypeError: ``model`` belongs to no known family.
  """
  for fam in FAMILIES.values():
    if isinstance(model, fam.model):
      return fam
  classes = " or ".join(f"{f.model.__module__}.{f.model.__name__}" for f in FAMILIES.values())
  raise TypeError(f"model must be a {classes}, got {type(model).__name__}")
