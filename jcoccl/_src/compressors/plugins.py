"""Codec plugins: native kernels of a compressor, from a shared library built by its user.

A plugin library implements the C ABI of ``jcoccl/include/jcoccl/codec_plugin.h`` for one
codec whose jnp specification is a registered :class:`~jcoccl.compressors.Compressor`
family. :func:`load_plugin` opens it in every native module (``jcoccl._cpu``, and
``jcoccl._cuda`` where present), checks it, and sets the family's ``native`` hook so that its
compressors run the plugin's kernels in the codec custom calls (backend "xla") and in the
fused engine, instead of their jnp code.

Example:
  >>> import jcoccl.compressors as jc
  >>> jc.load_plugin("build/sign/libjcoccl_sign.so", spec=SignCompressor)  # doctest: +SKIP
  Plugin(name='sign1', ...)
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src.compressors import native, registry
from jcoccl._src.native import _ffi

ENTRY_SYMBOL = "jcoccl_codec_plugin_v1"  # JCOCCL_PLUGIN_ENTRY_SYMBOL
# Rows the payload sizes are compared at: these many granules (3: not a power of two).
CHECK_GRANULES = (1, 2, 3, 8)
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # JCOCCL_DTYPE_*
ABI_VERSION = 1  # JCOCCL_PLUGIN_ABI_VERSION
_BUILD_HINT = (
  "rebuild the plugin against this installation: cmake -S <plugin dir> -B <build dir> "
  "-Djcoccl_DIR=\"$(python -c 'import jcoccl; print(jcoccl.get_cmake_dir())')\""
)


class PluginReplacedWarning(UserWarning):
  """:func:`load_plugin` loaded a library for a codec that another loaded library served:
  the codec now runs the new library's kernels.

  Example:
    >>> warnings.simplefilter("error", PluginReplacedWarning)  # doctest: +SKIP
  """


@dataclasses.dataclass(frozen=True)
class Plugin:
  """A loaded plugin library.

  Attributes:
    path: the library's resolved path.
    id: the number jcoccl gave it (the FFI ``plugin`` attribute).
    name: the spec name of the codec family whose kernels it holds.
    param_names: the compressor fields passed to its kernels, in order.
    has_cuda: whether it has CUDA kernels.
    jcoccl_version: the jcoccl version its header came from.
  """

  path: str
  id: int
  name: str
  param_names: tuple[str, ...]
  has_cuda: bool
  jcoccl_version: str

  def params(self, c: Any) -> tuple[float, ...]:
    """The kernel parameters of compressor ``c``: its fields ``param_names`` as doubles."""
    return tuple(float(getattr(c, n)) for n in self.param_names)

  def fields(self, c: Any) -> dict[str, Any]:
    """The kernel fields of compressor ``c`` (the family's ``native`` hook); the first use
    of each configuration checks its payload sizes (:meth:`check_sizes`)."""
    if (self.id, c) not in _CHECKED:
      self.check_sizes(c)
      _CHECKED.add((self.id, c))
    return {"kind": "plugin", "plugin": self.id, "params": self.params(c)}

  def check_sizes(self, c: Any) -> None:
    """Compares the library's granule and payload bytes with the jnp specification's, for
    compressor ``c`` at several row lengths and every dtype.

    Raises:
      ValueError: naming the plugin, the codec, n, the dtype and both sizes.

    Example:
      >>> plugin.check_sizes(SignCompressor(block=64))  # doctest: +SKIP
    """
    _check_sizes(self.path, self.name, self.params(c), c)


_LOADED: dict[str, Plugin] = {}  # resolved path -> plugin
_LOCK = threading.Lock()
_CHECKED: set = set()  # (plugin id, compressor) pairs whose payload sizes matched


def loaded() -> tuple[Plugin, ...]:
  """The plugins loaded so far, in load order.

  Example:
    >>> loaded()  # doctest: +SKIP
    ()
  """
  return tuple(_LOADED.values())


def _major_minor(version: str) -> tuple[str, ...]:
  return tuple(re.split(r"[.+-]", version)[:2])


def _describe_error(info: dict[str, Any], path: str) -> str | None:
  """Why the library described by ``info`` cannot be loaded, or None."""
  status, detail = info.get("status"), info.get("detail", "")
  if status == "open":
    return f"load_plugin: cannot open {path!r}: {detail}; check the file is a shared library built for this machine (and that its own dependencies are found)"
  if status == "symbol":
    return f'load_plugin: {path!r} does not export the entry symbol {ENTRY_SYMBOL!r} ({detail}); define it with JCOCCL_PLUGIN_EXPORT and extern "C" (see jcoccl/codec_plugin.h)'
  if status == "null":
    return f"load_plugin: {path!r}: {ENTRY_SYMBOL}() returned NULL; return a pointer to a static jcoccl_codec_plugin"
  if status == "abi":
    return f"load_plugin: {path!r} was built for plugin ABI version {info.get('abi_version')} ({detail}), but this jcoccl has ABI version {ABI_VERSION}; {_BUILD_HINT}"
  if status == "incomplete":
    return f"load_plugin: {path!r}: required entries are missing ({detail}); fill every CPU kernel, validate, granule, payload_bytes and last_error"
  if status != "ok":
    return f"load_plugin: {path!r}: unexpected status {status!r} ({detail})"
  return None


def _check_version(info: dict[str, Any], path: str) -> None:
  from jcoccl._src.version import version

  theirs, ours = str(info["jcoccl_version"]), version()
  if _major_minor(theirs) != _major_minor(ours):
    raise ImportError(
      f"load_plugin: {path!r} was built against jcoccl {theirs}, but this is jcoccl {ours} "
      f"(major.minor must match); {_BUILD_HINT}"
    )


def _family(name: str, spec: Any, path: str) -> registry.Family:
  """The jnp family named ``name``, registering ``spec`` under it if needed."""
  fam = registry.family_of_name(name)
  if fam is None:
    if spec is None:
      raise ValueError(
        f"load_plugin: {path!r} implements codec {name!r}, which is not a registered "
        f"compressor; pass spec=<its Compressor subclass> (the jnp specification) or call "
        f"jcoccl.compressors.register({name!r}, cls) first"
      )
    registry.register(name, spec)
    fam = registry.family_of_name(name)
    assert fam is not None
  elif spec is not None and fam.cls is not spec:
    raise ValueError(
      f"load_plugin: spec name {name!r} is registered to {fam.cls.__qualname__}, not "
      f"{getattr(spec, '__qualname__', spec)!r}; pass that class or spec=None"
    )
  if fam.wraps:
    raise ValueError(f"load_plugin: {name!r} is a wrapping family; plugins implement plain codecs")
  return fam


def _check_params(info: dict[str, Any], fam: registry.Family, path: str) -> tuple[str, ...]:
  names = tuple(str(n) for n in info["param_names"])
  most = native.max_plugin_params()
  if not 0 <= int(info["num_params"]) <= most:
    raise ValueError(
      f"load_plugin: {path!r}: num_params must be 0..{most}, got {info['num_params']}"
    )
  fields = {f.name for f in dataclasses.fields(fam.cls)}
  bad = [n for n in names if n not in fields]
  if bad:
    raise ValueError(
      f"load_plugin: {path!r} names params {bad} that are not fields of "
      f"{fam.cls.__qualname__} (fields: {sorted(fields)}); make param_names match the "
      "dataclass fields of the codec's jnp class"
    )
  return names


def _check_sizes(path: str, name: str, params: tuple[float, ...], c: Any) -> None:
  """See :meth:`Plugin.check_sizes`; ``path`` need not be installed yet."""
  cpu = _ffi.require_module("cpu")
  what = f"load_plugin: plugin {path!r} for codec {name!r} ({c})"
  g = int(c.granule)
  for k in CHECK_GRANULES:
    n = k * g
    for dtype, code in DTYPE_CODES.items():
      got = dict(cpu.plugin_shape(path, list(params), n, code))
      if got["status"] != "ok":
        raise ValueError(
          f"{what} refuses a row of n={n} {dtype} that the jnp specification accepts "
          f"({got['status']}: {got['detail']}); make validate, granule and payload_bytes "
          "accept every configuration the class accepts"
        )
      if int(got["granule"]) != g:
        raise ValueError(
          f"{what}: granule is {got['granule']}, but the jnp specification's granule is {g}; "
          "make the two agree"
        )
      want = int(c.row_nbytes(n, jnp.dtype(dtype)))
      if int(got["bytes"]) != want:
        raise ValueError(
          f"{what}: payload_bytes gives {got['bytes']} bytes for a row of n={n} {dtype}, but "
          f"the jnp specification's row_nbytes gives {want}; make the two agree"
        )


def _default_instance(fam: registry.Family) -> Any:
  """The family's compressor with every field at its default, or None if a field has none."""
  try:
    return fam.cls()
  except TypeError:  # a required field: checked at the first use of each compressor instead
    return None


def _cuda_module() -> Any:
  """jcoccl._cuda if importable, else None."""
  return _ffi.native_module("cuda")


def _on_gpu() -> bool:
  try:
    return jax.default_backend() in ("gpu", "cuda")
  except RuntimeError:
    return False


def load_plugin(path: str | os.PathLike, spec: Any = None) -> Plugin:
  """Loads a codec plugin library, so that its codec runs natively.

  Opens ``path`` in jcoccl's native modules, checks its ABI and jcoccl version, and sets the
  ``native`` hook of the codec's family: every compressor of that family then runs the
  plugin's kernels with ``impl="auto"``/``"native"``, ``backend="xla"`` and
  ``backend="fused"``. Loading the same file again returns the same :class:`Plugin`.

  At load, the library's granule and payload bytes are compared with the jnp
  specification's (the class with its default fields, at several row lengths, every
  dtype), and again at the first use of each other configuration. A library for a codec
  that another loaded library serves replaces it, with a :class:`PluginReplacedWarning`.

  Args:
    path: the plugin shared library (built with ``find_package(jcoccl CONFIG)``; see
      ``examples/custom_codecs/sign``).
    spec: the codec's Compressor subclass (its jnp specification), registered under the
      plugin's codec name if that name is not registered yet; None when it is.

  Returns:
    The loaded :class:`Plugin`.

  Raises:
    FileNotFoundError: no file at ``path``.
    OSError: the file cannot be opened as a shared library.
    ImportError: no entry symbol, another ABI version, or built for another jcoccl.
    ValueError: the codec name is not registered and no ``spec`` was given; the plugin's
      param names are not fields of the class; its granule or payload bytes differ from
      the specification's (the message names the plugin, codec, n, dtype and both sizes);
      no CUDA kernels while the default backend is a GPU.

  Example:
    >>> plugin = load_plugin("build/sign/libjcoccl_sign.so", spec=Sign1)  # doctest: +SKIP
    >>> jc.parse("sign1:block=256").encode_rows(x, impl="native")  # doctest: +SKIP
  """
  shown = os.fspath(path)
  real = os.path.realpath(shown)
  with _LOCK:
    if real in _LOADED:
      plugin = _LOADED[real]
      if spec is not None:
        _family(plugin.name, spec, shown)
      return plugin
    if not os.path.isfile(real):
      raise FileNotFoundError(
        f"load_plugin: no plugin library at {shown!r}; build it first (see "
        "examples/custom_codecs/sign/README.md) and pass the path of its .so"
      )
    return _load(shown, real, spec)


def _load(shown: str, real: str, spec: Any) -> Plugin:
  cpu = _ffi.require_module("cpu")
  plugin_id = len(_LOADED)
  if plugin_id >= int(cpu.plugin_max()):
    raise ValueError(f"load_plugin: at most {cpu.plugin_max()} plugin libraries per process")
  info = dict(cpu.plugin_load(real, plugin_id, False))
  why = _describe_error(info, shown)
  if why is not None:
    raise (OSError if info.get("status") == "open" else ImportError)(why)
  _check_version(info, shown)
  name = str(info["name"])
  fam = _family(name, spec, shown)
  params = _check_params(info, fam, shown)
  cuda = _cuda_module()
  if not info["has_cuda"] and cuda is not None and _on_gpu():
    raise ValueError(
      f"load_plugin: {shown!r} has no CUDA kernels (cuda_* entries are NULL) but the default "
      "backend is a GPU; build the plugin with its CUDA kernels (jcoccl_add_codec_plugin "
      "with CUDA_SOURCES, where CMake finds nvcc), or run on CPU"
    )
  default = _default_instance(fam)
  if default is not None:
    _check_sizes(shown, name, tuple(float(getattr(default, p)) for p in params), default)
  replaced = [p for p in _LOADED.values() if p.name == name]
  cpu.plugin_load(real, plugin_id, True)
  if cuda is not None and info["has_cuda"]:
    cuda.plugin_load(real, plugin_id, True)
  plugin = Plugin(
    path=real,
    id=plugin_id,
    name=name,
    param_names=params,
    has_cuda=bool(info["has_cuda"]),
    jcoccl_version=str(info["jcoccl_version"]),
  )
  if replaced:
    warnings.warn(
      f"load_plugin: {shown!r} replaces {replaced[-1].path!r} as the kernels of codec "
      f"{name!r}; its compressors now run the new library's (programs traced before trace "
      "again)",
      PluginReplacedWarning,
      stacklevel=3,
    )
  registry.set_native(name, plugin.fields)
  _LOADED[real] = plugin
  return plugin
