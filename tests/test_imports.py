"""No import cycle among the project's modules (jcoccl/ and models/).

Every module is parsed with ``ast`` (nothing is imported), and every import of a project
module counts, at the top level or inside a function: a lazy import only hides a cycle until
the function runs. ``from pkg import name`` counts as an import of ``pkg.name`` when that is a
module, else of ``pkg``; ``import a.b`` as one of ``a.b``. The parent packages that Python
initialises on the way are not counted: a submodule may import ``jcoccl._src.x`` while
``jcoccl/__init__`` imports it, as every public module re-exporting from ``_src`` does.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jcoccl", "models")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def project_modules() -> dict[str, pathlib.Path]:
  """Module name -> source file, for every .py file under PACKAGES."""
  return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
  """The absolute module of a ``from ... import`` (relative levels resolved)."""
  if not node.level:
    return node.module or ""
  base = name.split(".")
  base = base[: len(base) - node.level + (1 if is_package else 0)]
  return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: pathlib.Path, modules: dict) -> set[str]:
  """The project modules that ``name`` (file ``path``) imports anywhere in its body."""
  found: set[str] = set()

  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
      mod = _absolute(node, name, path.name == "__init__.py")
      for alias in node.names:
        sub = f"{mod}.{alias.name}"
        if sub in modules:
          found.add(sub)
        elif mod in modules:
          found.add(mod)
  found.discard(name)
  return found


def import_graph(prefixes: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
  """Module -> the project modules it imports, restricted to modules under ``prefixes``."""
  modules = project_modules()
  keep = lambda m: m.split(".")[0] in prefixes
  return {
    m: {d for d in imports_of(m, p, modules) if keep(d)} for m, p in modules.items() if keep(m)
  }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one module (Tarjan), each
  as a closed path ``[a, b, ..., a]``, sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        components.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(_cycle_in(graph, set(c)) for c in components)


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
  """A shortest closed path through the first module of a strongly connected component."""
  start = min(comp)
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & comp):
        if w == start:
          return paths[v] + [start]
        if w not in paths:
          paths[w] = paths[v] + [w]
          nxt.append(w)
    frontier = nxt
  raise AssertionError(f"{sorted(comp)} is not strongly connected")


def _report(cycles: list[list[str]]) -> str:
  return "import cycles (top-level and lazy imports):\n" + "\n".join(
    "  " + " -> ".join(c) for c in cycles
  )


def test_finder_sees_lazy_imports_and_cycles(tmp_path):
  """The checker itself: a cycle closed by an import inside a function is found."""
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert find_cycles(graph) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []
  src = tmp_path / "m.py"
  src.write_text(
    "import os\nfrom models.data import load\n\ndef f():\n  from models import sample, VERSION\n"
  )
  modules = {"models", "models.data", "models.sample", "models.x"}
  assert imports_of("models.x", src, modules) == {"models", "models.data", "models.sample"}


def test_models_have_no_import_cycle():
  """models/ (with the jcoccl modules it reaches): no cycle that passes through models/."""
  cycles = [c for c in find_cycles(import_graph()) if any(m.startswith("models") for m in c)]
  assert not cycles, _report(cycles)


def test_jcoccl_has_no_import_cycle():
  cycles = find_cycles(import_graph(("jcoccl",)))
  assert not cycles, _report(cycles)


def test_importing_the_scripts_leaves_xla_flags_alone():
  """Only the entry points' main() asks for host CPU devices; importing models.train or
  models.sample (as tests and benchmarks do) changes no environment variable."""
  code = (
    "import os, models.train, models.sample\n"
    "assert 'XLA_FLAGS' not in os.environ, os.environ['XLA_FLAGS']\n"
    "from models.run_config import use_host_devices\n"
    "use_host_devices()\n"
    "import glob\n"
    "want = None if glob.glob('/dev/nvidia[0-9]*') else "
    "'--xla_force_host_platform_device_count=8'\n"
    "assert os.environ.get('XLA_FLAGS') == want, os.environ.get('XLA_FLAGS')\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 0, r.stderr
