"""jcoccl/_src's folders are its layers (docs/architecture.md): a module imports only from
its own folder or one below it, lazy imports inside functions included."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "jcoccl" / "_src"
# Bottom up; "" is the top level of _src (_compat, _env, version).
LAYERS = ["", "base", "native", "compressors", "engine", "ops", "observability", "integrations"]


def _layer(module: str) -> int | None:
  """The layer of a dotted jcoccl._src module name (None outside _src)."""
  parts = module.split(".")
  if parts[:2] != ["jcoccl", "_src"] or len(parts) < 3:
    return None
  return LAYERS.index(parts[2]) if parts[2] in LAYERS else 0


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [f"{node.module}.{a.name}" for a in node.names]
      found += [(node.lineno, n if node.module == "jcoccl._src" else node.module) for n in names]
    elif isinstance(node, ast.Import):
      found += [(node.lineno, a.name) for a in node.names]
  return found


def test_every_module_is_in_a_layer_folder():
  assert sorted(p.name for p in SRC.glob("*.py")) == [
    "__init__.py",
    "_compat.py",
    "_env.py",
    "version.py",
  ]
  assert sorted(p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
    LAYERS[1:]
  )


def test_no_module_imports_from_a_layer_above_its_own():
  upward = []
  for path in sorted(SRC.rglob("*.py")):
    rel = path.relative_to(SRC)
    own = LAYERS.index(rel.parts[0]) if len(rel.parts) > 1 else 0
    for line, name in _imports(ast.parse(path.read_text())):
      layer = _layer(name)
      if layer is not None and layer > own:
        upward.append(
          f"{rel}:{line} imports {name} ({LAYERS[layer]} is above {LAYERS[own] or 'top level'})"
        )
  assert not upward, "\n".join(upward)
