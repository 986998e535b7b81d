"""The installation: native extensions, `python -m jcoccl info`."""

import json
import shutil
import subprocess
import sys

import pytest

import jcoccl
from jcoccl._src import _ffi


def test_cpu_extension_loads_and_registers():
  assert _ffi.native_module("cpu") is not None, _ffi.native_import_error("cpu")
  assert _ffi.register("cpu"), "jcoccl._cpu registered no FFI targets"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the CUDA extension is optional")
def test_cuda_extension_built_where_nvcc_exists():
  mod = _ffi.native_module("cuda")
  assert mod is not None, _ffi.native_import_error("cuda")
  assert mod.registrations(), "jcoccl._cuda has no FFI targets"


def test_info_reports_versions_and_extensions():
  d = jcoccl.info()
  assert d["jax"] and d["jaxlib"] and d["jcoccl"] == jcoccl.__version__
  assert d["extensions"]["cpu"]["loaded"]
  assert d["devices"]


def test_info_command_line_json():
  out = subprocess.run([sys.executable, "-m", "jcoccl", "info", "--json"], check=True,
                       capture_output=True, text=True).stdout
  assert json.loads(out)["extensions"]["cpu"]["loaded"]
