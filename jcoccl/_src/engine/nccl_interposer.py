"""libjcoccl_nccl.so from Python: the policy it reads, turning it on, its counters.

libjcoccl_nccl.so (cuda/nccl_interposer/, docs/nccl.md) is a library with NCCL's ABI and
SONAME (libnccl.so.2). Loaded before the real NCCL, it is what XLA's CUDA plugin finds when
it opens "libnccl.so.2" by name; it forwards every call to the real library and runs the
all-reduces, reduce-scatters and all-gathers that the policy names with jcoccl's fused
engine, so a JAX program is compressed without a change to its code.

The policy is a jcoccl.Policy TOML file whose tables name communicators instead of mesh axes
(XLA's collectives carry no axis names). An ``[nccl]`` table maps each table to the
communicator size it stands for; ``"*"`` is every other communicator::

  [nccl]
  axes = {data = 4}               # a 4-rank communicator is 'data'
  dtypes = ["float32", "bfloat16"]  # default: float32, bfloat16, float16
  chunks = 1                      # pipeline slices per call (1..64)

  [data]
  all_reduce = "int8"
  reduce_scatter = "int8"
  min_bytes = 1048576             # jcoccl's default (4 MiB) when absent

:func:`resolve` checks it with :class:`jcoccl.Policy` and writes the flat rules the library
reads (one line per table and op); a bad policy raises a ValueError naming the file, table
and key, and the job then runs uncompressed.

Example:
  >>> rules = resolve("p.toml")          # doctest: +SKIP
  >>> enable("p.toml")                   # doctest: +SKIP  (after import jax, before devices)
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LIBRARY_NAME = "libjcoccl_nccl.so"
OPS = ("all_reduce", "reduce_scatter", "all_gather")
DTYPES = ("float32", "bfloat16", "float16")
_ALGORITHMS = ("auto", "one_shot", "two_shot")
_SECTION = "nccl"


@dataclasses.dataclass(frozen=True)
class Rule:
  """One resolved rule: calls of ``op`` on communicators of ``size`` ranks (0: any) in one of
  ``dtypes`` of at least ``min_bytes`` bytes per rank use ``codec``.

  Attributes:
    table: the policy table it came from (``"data"``, ``"*"``).
    size: communicator size, 0 for any.
    op: all_reduce, reduce_scatter or all_gather.
    dtypes: element types it applies to.
    min_bytes: smaller messages are forwarded uncompressed.
    algorithm: all_reduce's algorithm (auto: two_shot above 2 ranks, else one_shot).
    chunks: pipeline slices per call.
    codec: the compressor's name, as the policy wrote it.
    fields: the codec's descriptor in its text form (``kind=2 bits=8 ...``: every field of
      C++'s schema, compressors/native.py ``codec_text``), as the engine takes it.
  """

  table: str
  size: int
  op: str
  dtypes: tuple[str, ...]
  min_bytes: int
  algorithm: str
  chunks: int
  codec: str
  fields: str

  def line(self) -> str:
    """The rule as the library reads it (``rule key=value ...``)."""
    codec = "".join(ch for ch in self.codec if not ch.isspace())
    parts = [
      f"size={self.size}",
      f"ops={self.op}",
      f"dtypes={','.join(self.dtypes)}",
      f"min_bytes={self.min_bytes}",
      f"algorithm={self.algorithm}",
      f"chunks={self.chunks}",
      f"codec={codec}",
      self.fields,
    ]
    return "rule " + " ".join(parts)


def _nccl_section(entry: Any, where: str) -> tuple[dict[str, int], tuple[str, ...], int]:
  if not isinstance(entry, Mapping):
    raise ValueError(f"{where} must be a table with axes, dtypes and chunks")
  for key in entry:
    if key not in ("axes", "dtypes", "chunks"):
      raise ValueError(f"{where} has unknown key {key!r}; accepted: axes, dtypes, chunks")
  axes = entry.get("axes", {})
  if not isinstance(axes, Mapping) or not all(
    isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in axes.values()
  ):
    raise ValueError(f"{where} axes must map table names to communicator sizes >= 2, got {axes!r}")
  dtypes = entry.get("dtypes", list(DTYPES))
  if isinstance(dtypes, str) or not isinstance(dtypes, Sequence) or not dtypes:
    raise ValueError(f"{where} dtypes must be a non-empty list of {list(DTYPES)}, got {dtypes!r}")
  for d in dtypes:
    if d not in DTYPES:
      raise ValueError(f"{where} dtypes: {d!r} is not one of {list(DTYPES)}")
  chunks = entry.get("chunks", 1)
  if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= 64:
    raise ValueError(f"{where} chunks must be an int in [1, 64], got {chunks!r}")
  return dict(axes), tuple(dtypes), chunks


def codec_fields(comp: Any) -> str:
  """The codec descriptor of compressor ``comp`` as a rule carries it: its text form,
  which interposer.cc decodes with the descriptor's own field table.

  Raises:
    ValueError: ``comp`` has no native kernel, or is a plugin's codec.

  Example:
    >>> codec_fields(jc.int8(block_size=32)).split()[2]   # doctest: +SKIP
    'block=32'
  """
  from jcoccl._src.compressors import native

  attrs = native.codec_attrs(comp)
  if int(attrs["plugin"]) >= 0:
    raise ValueError("plugin codecs cannot be used inside NCCL calls")
  return native.codec_text(attrs)


def resolve(path: str) -> list[Rule]:
  """Reads and checks a policy TOML file (see the module docstring).

  Args:
    path: the policy file.

  Returns:
    The rules, communicator sizes named in ``[nccl] axes`` first, ``"*"`` last.

  Raises:
    ValueError: a syntax error, an unknown key, a table without a communicator size, an op
      NCCL cannot show the library (all_to_all, ppermute: XLA sends them as send/recv, which
      are forwarded), an ``"auto:<spec>"`` entry (no cost model runs inside NCCL calls), a
      codec without a native kernel.

  Example:
    >>> [r.line() for r in resolve("p.toml")]   # doctest: +SKIP
  """
  from jcoccl._src.base import config as _config
  from jcoccl.policy import Policy, load_toml

  table = dict(load_toml(path))
  axes, dtypes, chunks = _nccl_section(table.pop(_SECTION, {}), f"{path}: [{_SECTION}]")
  policy = Policy.from_toml(path, table=table)
  rules: list[Rule] = []
  for name, axis in policy.axes.items():
    where = f"{path}: [{name}]"
    if name != "*" and name not in axes:
      raise ValueError(
        f"{where}: NCCL calls carry no axis names; say which communicator size it stands "
        f'for in [{_SECTION}] axes = {{{name} = N}}, or name the table "*" (every size)'
      )
    for op, comp in axis.compressors.items():
      if op not in OPS:
        raise ValueError(
          f"{where} {op}: XLA issues it as NCCL send/recv, which are forwarded uncompressed; "
          f"the library compresses {', '.join(OPS)}"
        )
      if op in axis.auto_ops:
        raise ValueError(
          f'{where} {op}: "auto:<spec>" needs jcoccl\'s cost model, which does not run inside '
          "NCCL calls; write the codec itself"
        )
      try:
        fields = codec_fields(comp)
      except ValueError as e:
        raise ValueError(f"{where} {op}: {e}") from None
      algorithm = axis.algorithm if axis.algorithm in _ALGORITHMS else None
      if algorithm is None:
        raise ValueError(f"{where} algorithm: one of {list(_ALGORITHMS)} inside NCCL calls")
      rules.append(
        Rule(
          table=name,
          size=0 if name == "*" else axes[name],
          op=op,
          dtypes=dtypes,
          min_bytes=(axis.min_bytes if axis.min_bytes is not None else _config.current().min_bytes),
          algorithm=algorithm,
          chunks=chunks,
          codec=str(comp),
          fields=fields,
        )
      )
  rules.sort(key=lambda r: r.size == 0)
  return rules


def write_rules(rules: Sequence[Rule], path: str | None = None) -> str:
  """Writes ``rules`` as the library's policy file; returns its path (a new temporary file
  when ``path`` is None)."""
  text = "# jcoccl nccl policy (jcoccl/_src/engine/nccl_interposer.py)\n"
  text += "".join(r.line() + "\n" for r in rules)
  if path is None:
    fd, path = tempfile.mkstemp(prefix="jcoccl_nccl_", suffix=".rules")
    os.close(fd)
  Path(path).write_text(text)
  return path


def describe(rules: Sequence[Rule]) -> str:
  """One line per rule, e.g. ``size 4 all_reduce: int8 (min_bytes 0, algorithm auto)``."""
  if not rules:
    return "no rules: every call is forwarded uncompressed"
  return "\n".join(
    f"{'any size' if r.size == 0 else f'size {r.size}'} {r.op}: {r.codec} "
    f"({'/'.join(r.dtypes)}, min_bytes {r.min_bytes}, algorithm {r.algorithm}"
    f"{' = two_shot above 2 ranks, else one_shot' if r.algorithm == 'auto' and r.op == 'all_reduce' else ''}"
    f", chunks {r.chunks})"
    for r in rules
  )


# ---- the library -------------------------------------------------------------------------------


def library_path() -> str | None:
  """libjcoccl_nccl.so: ``JCOCCL_NCCL_INTERPOSER``, else the one installed in the package,
  else the one built next to jcoccl._cuda (an editable install's build directory)."""
  import importlib.util

  env = os.environ.get("JCOCCL_NCCL_INTERPOSER")
  if env:
    return env
  places = [Path(__file__).resolve().parents[2]]  # jcoccl/ (this file: _src/engine/)
  try:
    spec = importlib.util.find_spec("jcoccl._cuda")
  except ImportError:
    spec = None
  if spec is not None and spec.origin:
    places.append(Path(spec.origin).parent)
  for d in places:
    if (d / LIBRARY_NAME).exists():
      return str(d / LIBRARY_NAME)
  return None


def real_nccl_path() -> str | None:
  """The real libnccl.so.2: ``JCOCCL_NCCL_REAL``, ``JCOCCL_NCCL_LIBRARY``, else the
  nvidia-nccl-cu13 wheel's."""
  for var in ("JCOCCL_NCCL_REAL", "JCOCCL_NCCL_LIBRARY"):
    if os.environ.get(var):
      return os.environ[var]
  try:
    import nvidia.nccl
  except ImportError:
    return None
  path = os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2")
  return path if os.path.exists(path) else None


def _by_soname() -> ctypes.CDLL | None:
  """What a dlopen("libnccl.so.2") by name gets in this process now (what XLA's plugin
  would get), or None when no object of that SONAME is loaded."""
  try:
    return ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
  except OSError:
    return None


def _loaded_interposer() -> ctypes.CDLL | None:
  lib = _by_soname()
  return lib if lib is not None and hasattr(lib, "jcoccl_nccl_status") else None


def _text(lib: ctypes.CDLL, fn: str) -> str:
  f = getattr(lib, fn)
  f.restype = ctypes.c_char_p
  return f().decode()


def status() -> dict[str, str]:
  """The loaded library's state (``active``, ``real``, ``policy``, ``rules``, errors), or
  ``{"active": "0", "loaded": "0"}`` when it is not in this process.

  Example:
    >>> status()["active"]
    '0'
  """
  lib = _loaded_interposer()
  if lib is None:
    return {"active": "0", "loaded": "0"}
  out = {"loaded": "1"}
  for line in _text(lib, "jcoccl_nccl_status").splitlines():
    k, _, v = line.partition("=")
    out[k] = v
  return out


def summary() -> str:
  """One line for ``jcoccl info``: whether libjcoccl_nccl.so answers for libnccl.so.2 here.

  Example:
    >>> summary()
    'not loaded (python -m jcoccl.nccl or jcoccl.nccl.enable turn it on)'
  """
  st = status()
  if st.get("loaded") == "0":
    return "not loaded (python -m jcoccl.nccl or jcoccl.nccl.enable turn it on)"
  state = "active" if st.get("active") == "1" else "loaded, forwarding only"
  why = st.get("error") or st.get("policy_error") or ""
  return (
    f"{state}: {st.get('rules', '0')} rules from {st.get('policy')}, real NCCL {st.get('real')}"
    + (f" ({why})" if why else "")
  )


def counters() -> list[dict[str, Any]]:
  """What the library did in this process: one dict per communicator and op (``comm``,
  ``size``, ``rank``, ``op``, ``taken_calls``, ``taken_bytes``, ``taken_wire``,
  ``captured_calls``, ``forwarded_calls``, ``forwarded_bytes``, ``forwarded_wire``; bytes are
  the messages' own, wire bytes what this rank handed to NCCL, for forwarded calls those of
  NCCL's ring; a call captured into a CUDA graph counts once, at its capture, not per
  replay), then ``{"grouped": {"taken_at_group_end": calls}}`` (calls issued inside
  ncclGroupStart / ncclGroupEnd, as XLA issues them) and ``{"forwarded": {reason: calls}}``
  (reasons ``no_rule``, ``other_type``, ``workspace``, ``disabled``). Empty when the library
  is not loaded.

  Example:
    >>> counters()
    []
  """
  lib = _loaded_interposer()
  return [] if lib is None else parse_counters(_text(lib, "jcoccl_nccl_counters"))


def parse_counters(text: str) -> list[dict[str, Any]]:
  """The counters' text (``jcoccl_nccl_counters``) as :func:`counters` returns it."""
  out: list[dict[str, Any]] = []
  for line in text.splitlines():
    words = line.split()
    if not words:
      continue
    if words[0] in ("forwarded", "grouped"):
      out.append({words[0]: {k: int(v) for k, v in (w.split("=") for w in words[1:])}})
      continue
    d: dict[str, Any] = {}
    for w in words:
      k, _, v = w.partition("=")
      d[k] = v if k in ("comm", "op") else int(v)
    out.append(d)
  return out


def enable(policy: str, *, library: str | None = None, real: str | None = None) -> list[Rule]:
  """Loads libjcoccl_nccl.so into this process with ``policy``, so that the collectives XLA
  issues through NCCL are compressed as it says.

  Call it after ``import jax`` and before the GPU backend starts (the first
  ``jax.devices()``, array or ``jax.distributed.initialize``): XLA's CUDA plugin then finds
  this library when it opens "libnccl.so.2" by name.

  Args:
    policy: a policy TOML file (see the module docstring).
    library: libjcoccl_nccl.so (default :func:`library_path`).
    real: the real libnccl.so.2 (default :func:`real_nccl_path`).

  Returns:
    The rules in force.

  Raises:
    ValueError: a bad policy (nothing is loaded: NCCL runs uncompressed).
    RuntimeError: the library or the real NCCL cannot be found, or a libnccl.so.2 is already
      loaded (the backend started first; the interposer would never be found).

  Example:
    >>> import jax, jcoccl.nccl
    >>> jcoccl.nccl.enable("p.toml")   # doctest: +SKIP
  """
  rules = resolve(policy)
  lib = library or library_path()
  if lib is None or not os.path.exists(lib):
    raise RuntimeError(
      f"{LIBRARY_NAME} not found ({lib or 'not built'}): build jcoccl with CUDA "
      "(JCOCCL_CUDA=ON) or set JCOCCL_NCCL_INTERPOSER to its path"
    )
  nccl = real or real_nccl_path()
  if nccl is None or not os.path.exists(nccl):
    raise RuntimeError(
      "the real libnccl.so.2 was not found: install nvidia-nccl-cu13 or set JCOCCL_NCCL_REAL"
    )
  if _by_soname() is not None and _loaded_interposer() is None:
    raise RuntimeError(
      "a libnccl.so.2 is already loaded, so XLA would keep using it: call "
      "jcoccl.nccl.enable before the GPU backend starts (before jax.devices() or the first "
      "array), or start the program with python -m jcoccl.nccl --policy p.toml -- ..."
    )
  os.environ["JCOCCL_NCCL_REAL"] = nccl
  os.environ["JCOCCL_NCCL_POLICY"] = write_rules(rules)
  handle = ctypes.CDLL(lib, mode=ctypes.RTLD_LOCAL)  # the plugin finds it by its SONAME
  # Loaded before (LD_PRELOAD, an earlier enable): its constructor has run, give it the rules.
  handle.jcoccl_nccl_load_policy(os.environ["JCOCCL_NCCL_POLICY"].encode())
  return rules


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m jcoccl.nccl --policy p.toml -- cmd ...``: runs ``cmd`` with
  libjcoccl_nccl.so preloaded (LD_PRELOAD) and the policy in force; a bad policy or a
  missing library is reported and ``cmd`` runs uncompressed."""
  import argparse
  import subprocess

  argv = list(sys.argv[1:] if argv is None else argv)
  cmd: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, cmd = argv[:i], argv[i + 1 :]
  p = argparse.ArgumentParser(
    prog="python -m jcoccl.nccl",
    description="Run a command with its NCCL collectives compressed by jcoccl (docs/nccl.md).",
    epilog="Example: python -m jcoccl.nccl --policy p.toml -- python train.py",
  )
  p.add_argument("--policy", required=True, help="policy TOML file (docs/nccl.md)")
  p.add_argument("--library", default=None, help=f"{LIBRARY_NAME} (default: the package's)")
  p.add_argument("--real", default=None, help="the real libnccl.so.2 (default: the wheel's)")
  p.add_argument("--report", action="store_true", help="print the counters at exit")
  args = p.parse_args(argv)
  if not cmd:
    p.error("give the command after --, e.g. -- python train.py")
  env = dict(os.environ)
  try:
    rules = resolve(args.policy)
    lib = args.library or library_path()
    nccl = args.real or real_nccl_path()
    if lib is None or not os.path.exists(lib):
      raise RuntimeError(f"{LIBRARY_NAME} not found ({lib or 'not built'})")
    if nccl is None or not os.path.exists(nccl):
      raise RuntimeError("the real libnccl.so.2 was not found (set JCOCCL_NCCL_REAL)")
  except (ValueError, RuntimeError) as e:
    print(f"jcoccl.nccl: {e}\njcoccl.nccl: running the command uncompressed", file=sys.stderr)
  else:
    print(f"jcoccl.nccl: {describe(rules)}", file=sys.stderr)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env["JCOCCL_NCCL_REAL"] = nccl
    env["JCOCCL_NCCL_POLICY"] = write_rules(rules)
    if args.report:
      env["JCOCCL_NCCL_REPORT"] = "1"
  return subprocess.run(cmd, env=env).returncode
