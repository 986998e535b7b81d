"""The installation: native extensions, `python -m jcoccl info`."""

import ast
import json
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest

import jcoccl
import jcoccl.compressors
from jcoccl._src.native import _ffi


def test_cpu_extension_loads_and_registers():
  assert _ffi.native_module("cpu") is not None, _ffi.native_import_error("cpu")
  assert _ffi.register("cpu"), "jcoccl._cpu registered no FFI targets"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the CUDA extension is optional")
def test_cuda_extension_built_where_nvcc_exists():
  mod = _ffi.native_module("cuda")
  assert mod is not None, _ffi.native_import_error("cuda")
  assert mod.registrations(), "jcoccl._cuda has no FFI targets"


def test_cuda_targets_are_filed_under_the_cuda_plugins_platform(monkeypatch):
  """The CUDA PJRT plugin reads handlers filed under "CUDA"; "cuda" would never reach it."""
  from jaxlib import xla_client

  class FakeCuda:
    @staticmethod
    def registrations():
      return {"jcoccl_fake_target": object()}

  filed = []
  monkeypatch.setattr(_ffi, "_import", lambda platform: FakeCuda)
  monkeypatch.setattr(
    _ffi.jax.ffi, "register_ffi_target", lambda name, fn, platform: filed.append(platform)
  )
  assert _ffi._register.__wrapped__("cuda") == {"jcoccl_fake_target"}
  assert [xla_client.xla_platform_names.get(p, p) for p in filed] == ["CUDA"]


def test_info_reports_versions_and_extensions():
  d = jcoccl.info()
  assert d["jax"] and d["jaxlib"] and d["jcoccl"] == jcoccl.__version__
  assert d["extensions"]["cpu"]["loaded"]
  assert d["devices"]


def test_info_command_line_json():
  out = subprocess.run(
    [sys.executable, "-m", "jcoccl", "info", "--json"], check=True, capture_output=True, text=True
  ).stdout
  assert json.loads(out)["extensions"]["cpu"]["loaded"]


def test_native_module_exports_the_ffi_enums():
  """Python reads the C++ enum values from the module instead of mirroring them."""
  from jcoccl._src.compressors import native
  from jcoccl._src.engine import fused_ffi

  kinds = _ffi.codes("CODEC_KINDS")
  assert set(kinds) == {"none", "cast", "int", "fp8", "error_bounded", "plugin"}
  assert len(set(kinds.values())) == len(kinds)
  assert set(_ffi.codes("DTYPES")) == {"float32", "bfloat16", "float16"}
  assert native.codec_attrs(jcoccl.compressors.int8())["kind"] == kinds["int"]
  assert (
    native.codec_attrs(jcoccl.compressors.fp8("e5m2"))["fp8"] == _ffi.codes("FP8_FORMATS")["e5m2"]
  )
  ops = _ffi.codes("OPS")
  assert len(set(ops.values())) == len(ops) == 10
  codes = {
    fused_ffi.op_code(op, algo, None, jnp.float32)
    for op, algo in [
      ("all_reduce", "one_shot"),
      ("all_reduce", "two_shot"),
      ("all_reduce", "hierarchical"),
      ("reduce_scatter", "reduce_scatter"),
      ("all_gather", "all_gather"),
      ("all_to_all", "all_to_all"),
      ("ppermute", "ppermute"),
      ("all_reduce", "plain"),
      ("reduce_scatter", "plain"),
      ("all_gather", "plain"),
    ]
  }
  assert codes == set(ops.values())
  with pytest.raises(ValueError, match="table must be one of"):
    _ffi.codes("NOPE")


def _import_graph(root: pathlib.Path) -> dict[str, set[str]]:
  """Module -> the jcoccl modules it imports (anywhere in it, late imports included)."""
  mods = {}
  for p in root.rglob("*.py"):
    name = ".".join(p.relative_to(root.parent).with_suffix("").parts)
    mods[name.removesuffix(".__init__")] = p
  graph = {}
  for name, p in mods.items():
    deps = set()
    for node in ast.walk(ast.parse(p.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jcoccl"):
        deps |= {
          f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
          for a in node.names
        }
      elif isinstance(node, ast.Import):
        deps |= {a.name for a in node.names if a.name.startswith("jcoccl")}
    graph[name] = {d for d in deps if d in mods and d != name}
  return graph


def test_no_import_cycles_in_the_package():
  """No module of jcoccl/ reaches itself through imports (the public package included)."""
  graph = _import_graph(pathlib.Path(jcoccl.__file__).parent)
  for start in graph:
    stack, seen = [(start, (start,))], set()
    while stack:
      mod, path = stack.pop()
      for dep in graph[mod]:
        assert dep != start, "import cycle: " + " -> ".join((*path, dep))
        if dep not in seen:
          seen.add(dep)
          stack.append((dep, (*path, dep)))
