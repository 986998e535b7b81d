#!/usr/bin/env python3
"""SASS report of the CUDA kernels: registers, spills, wide and byte loads, divisions in loops.

The sources are compiled once with the project's flags (tools/gpu_ptx.py's compile step, which
also keeps the cubin); nvdisasm disassembles the cubin, and each kernel's control-flow graph
gives its loops (natural loops: the edges whose target dominates their source). Per kernel:

  registers    per thread (ptxas)            spill        spill bytes stored + loaded (ptxas)
  ld128/st128  LDG/STG .128 in loops, all    u8 ld        LDG .U8/.S8 inside loops
  div64        calls to __cuda_sm20_{div,rem}_{s,u}64 inside loops
  fdiv         IEEE division or reciprocal inside loops: calls to the div.rn / rcp.rn slow
               paths (each `a / b` on floats is FCHK + MUFU.RCP + a call; __fdividef has none)

tools/sass_thresholds.json holds one entry per kernel: max registers, spills, byte loads and
divisions, min 128-bit accesses in loops. A kernel above a maximum, below a minimum, or
without an entry fails, naming the kernel, the measure, the value and the threshold.

  python tools/gpu_sass.py                    # table, exit 1 on a regression
  python tools/gpu_sass.py --json report.json # the same measures as JSON too
  python tools/gpu_sass.py --update           # write today's values as the thresholds
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_ptx

ROOT = gpu_ptx.ROOT
THRESHOLDS = ROOT / "tools" / "sass_thresholds.json"
# Measure -> (threshold key, kind): a "max" fails above its threshold, a "min" below it.
LIMITS = {
  "registers": ("max_registers", "max"),
  "spill_bytes": ("max_spill_bytes", "max"),
  "ld128_in_loops": ("min_ld128_in_loops", "min"),
  "st128_in_loops": ("min_st128_in_loops", "min"),
  "byte_loads_in_loops": ("max_byte_loads_in_loops", "max"),
  "div64_in_loops": ("max_div64_in_loops", "max"),
  "fdiv_in_loops": ("max_fdiv_in_loops", "max"),
}
DIV64 = re.compile(r"__cuda_sm\w*_(div|rem)_[su]64\b")
FDIV = re.compile(r"__cuda_sm\w*_(div_rn|rcp_rn|drcp_rn|div_f64|rcp_f64)\w*")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)(.*)$")
# nvdisasm's dataflow names an indirect branch's targets: `BRX R4 -0x310 (*"BRANCH_TARGETS .L_x_1,.L_x_2"*)`.
_BRX_TARGETS = re.compile(r'BRANCH_TARGETS\s+([^"]*)"')
_LABEL = re.compile(r"^([.$\w][\w.$]*):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")


@dataclasses.dataclass
class Instr:
  addr: int
  guard: str  # "" when unconditional, else the guard predicate ("@!P0")
  op: str  # opcode with its modifiers, e.g. "LDG.E.128.CONSTANT"
  args: str
  targets: list[str]  # branch or call targets (labels)


@dataclasses.dataclass
class KernelReport:
  """One kernel's measures; `*_in_loops` count instructions inside any loop of the kernel."""

  name: str
  mangled: str
  registers: int = 0
  spill_bytes: int = 0
  stack_bytes: int = 0
  loops: int = 0
  max_loop_depth: int = 0
  ld128: int = 0
  ld128_in_loops: int = 0
  st128: int = 0
  st128_in_loops: int = 0
  byte_loads: int = 0
  byte_loads_in_loops: int = 0
  global_loads_in_loops: int = 0
  div64: int = 0
  div64_in_loops: int = 0
  fdiv: int = 0
  fdiv_in_loops: int = 0


def nvdisasm() -> str | None:
  """nvdisasm from $NVDISASM, PATH, next to nvcc, or the nvidia-cuda-nvdisasm wheel."""
  cands = [os.environ.get("NVDISASM"), shutil.which("nvdisasm")]
  cc = gpu_ptx.nvcc()
  if cc:
    cands.append(str(Path(os.path.realpath(cc)).parent / "nvdisasm"))
  spec = importlib.util.find_spec("nvidia")
  for loc in (spec.submodule_search_locations or []) if spec else []:
    cands += [str(p) for p in sorted(Path(loc).glob("cu*/bin/nvdisasm"))]
    cands.append(os.path.join(loc, "cuda_nvdisasm", "bin", "nvdisasm"))
  return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def disassemble(cubin: Path) -> str:
  """nvdisasm's code sections of `cubin` (with its dataflow: BRX targets are annotated)."""
  exe = nvdisasm()
  if exe is None:
    raise RuntimeError("nvdisasm not found (set NVDISASM, or pip install nvidia-cuda-nvdisasm)")
  r = subprocess.run([exe, "-c", str(cubin)], capture_output=True, text=True)
  if r.returncode != 0:
    raise RuntimeError(f"nvdisasm {cubin} failed: {r.stderr[-2000:]}")
  return r.stdout


def split_functions(sass: str) -> dict[str, tuple[list[Instr], dict[str, int]]]:
  """{mangled kernel: (instructions in address order, label -> address)} per .text section.

  A section holds its kernel and the subroutines it calls (`$__internal_*`), which only a
  CALL reaches; the CFG below starts at the kernel's entry, so they are not its loops.
  """
  out: dict[str, tuple[list[Instr], dict[str, int]]] = {}
  instrs: list[Instr] = []
  labels: dict[str, int] = {}
  pending: list[str] = []
  for line in sass.splitlines():
    if line.lstrip().startswith(".section") and ".text." in line:
      name = line.split(".text.", 1)[1].split(",", 1)[0]
      instrs, labels, pending = [], {}, []
      out[name] = (instrs, labels)
      continue
    m = _INSTR.match(line)
    if m and out:
      addr = int(m.group(1), 16)
      for lab in pending:
        labels[lab] = addr
      pending = []
      args = re.sub(r"\(\*.*?\*\)", "", m.group(4)).strip().rstrip(";").strip()
      targets = _TARGET.findall(args)
      brx = _BRX_TARGETS.search(line)
      if brx:
        targets += [t.strip() for t in brx.group(1).split(",") if t.strip()]
      instrs.append(Instr(addr, (m.group(2) or "").strip(), m.group(3), args, targets))
      continue
    label = _LABEL.match(line.strip())
    if label and out:
      pending.append(label.group(1))
  return out


def _is_branch(i: Instr) -> bool:
  return i.op.split(".")[0] in ("BRA", "BRX", "JMP", "JMX")


def _ends_flow(i: Instr) -> bool:
  """True when control never falls through `i` (an unguarded, unconditional jump or exit)."""
  if i.guard not in ("", "@PT"):
    return False
  base = i.op.split(".")[0]
  if base in ("EXIT", "RET", "BRX", "JMX"):
    return True
  # A predicate or register before the target (`BRA !P3, ...`, `BRA.DIV UR4, ...`) makes the
  # branch conditional even without a guard.
  return base in ("BRA", "JMP") and i.args.startswith("`")


def _blocks(instrs: list[Instr], labels: dict[str, int]) -> tuple[list[int], list[set[int]]]:
  """(block of each instruction, successors of each block); block 0 is the entry.

  Blocks start at labels and after branches and exits. An indirect branch without
  nvdisasm's target list may go to any label.
  """
  index = {i.addr: k for k, i in enumerate(instrs)}
  lab_idx = {lab: index[a] for lab, a in labels.items() if a in index}
  leaders = {0} | set(lab_idx.values())
  leaders |= {k + 1 for k, i in enumerate(instrs) if _is_branch(i) or _ends_flow(i)}
  starts = sorted(x for x in leaders if x < len(instrs))
  ends = [*starts[1:], len(instrs)]
  block_of = [b for b, (s, e) in enumerate(zip(starts, ends)) for _ in range(s, e)]
  succ: list[set[int]] = [set() for _ in starts]
  for b, e in enumerate(ends):
    last = instrs[e - 1]
    if _is_branch(last):
      tg = last.targets or ([] if last.op.startswith("BRA") else list(lab_idx))
      succ[b] |= {block_of[lab_idx[t]] for t in tg if t in lab_idx}
    if not _ends_flow(last) and e < len(instrs):
      succ[b].add(b + 1)
  return block_of, succ


def _dominators(succ: list[set[int]]) -> tuple[list[int], dict[int, list[int]], dict[int, int]]:
  """(blocks reachable from the entry in reverse post-order, their predecessors, idom).

  Cooper, Harvey and Kennedy's iteration over the reverse post-order.
  """
  order, seen, stack = [], {0}, [(0, iter(sorted(succ[0])))]
  while stack:
    b, it = stack[-1]
    nxt = next((s for s in it if s not in seen), None)
    if nxt is None:
      order.append(b)
      stack.pop()
    else:
      seen.add(nxt)
      stack.append((nxt, iter(sorted(succ[nxt]))))
  rpo = order[::-1]
  pos = {b: k for k, b in enumerate(rpo)}
  preds: dict[int, list[int]] = {b: [] for b in rpo}
  for b in rpo:
    for s in succ[b]:
      preds[s].append(b)
  idom = {0: 0}
  changed = True
  while changed:
    changed = False
    for b in rpo[1:]:
      done = [p for p in preds[b] if p in idom]
      new = done[0]
      for p in done[1:]:
        x, y = p, new
        while x != y:
          while pos[x] > pos[y]:
            x = idom[x]
          while pos[y] > pos[x]:
            y = idom[y]
        new = x
      if idom.get(b) != new:
        idom[b], changed = new, True
  return rpo, preds, idom


def loop_depths(instrs: list[Instr], labels: dict[str, int]) -> tuple[list[int], int]:
  """(loop depth of each instruction, number of loops) from the kernel's control-flow graph.

  A loop is the natural loop of a back edge (an edge whose target dominates its source);
  loops sharing a header are one. Code only a CALL reaches is in no loop of the kernel.
  """
  if not instrs:
    return [], 0
  block_of, succ = _blocks(instrs, labels)
  rpo, preds, idom = _dominators(succ)

  def dominates(a: int, b: int) -> bool:
    while b not in (a, 0):
      b = idom[b]
    return b == a

  bodies: dict[int, set[int]] = {}
  for b in rpo:
    for h in succ[b]:
      if dominates(h, b):
        body = bodies.setdefault(h, {h})
        work = [b]
        while work:
          x = work.pop()
          if x not in body:
            body.add(x)
            work += preds[x]
  depth = {b: sum(b in body for body in bodies.values()) for b in rpo}
  return [depth.get(b, 0) for b in block_of], len(bodies)


def ptxas_resources(report: str) -> dict[str, dict[str, int]]:
  """{mangled: {registers, spill_bytes, stack_bytes}} from a `ptxas -v` report."""
  res: dict[str, dict[str, int]] = {}
  cur = None
  for line in report.splitlines():
    m = re.search(r"Function properties for (\S+)", line)
    if m:
      cur = res.setdefault(m.group(1), {"registers": 0, "spill_bytes": 0, "stack_bytes": 0})
    m = re.search(
      r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
    )
    if m and cur is not None:
      cur["stack_bytes"] = int(m.group(1))
      cur["spill_bytes"] = int(m.group(2)) + int(m.group(3))
    m = re.search(r"Used (\d+) registers", line)
    if m and cur is not None:
      cur["registers"] = int(m.group(1))
  return res


def demangle(names: list[str]) -> dict[str, str]:
  """{mangled: demangled} through c++filt (binutils, which nvcc's host compiler needs)."""
  exe = shutil.which("c++filt")
  if exe is None or not names:
    return {n: n for n in names}
  r = subprocess.run([exe], input="\n".join(names), capture_output=True, text=True, check=True)
  return dict(zip(names, r.stdout.splitlines()))


def kind_names(header: Path = ROOT / "cuda" / "codecs" / "codec.h") -> dict[str, str]:
  """{"2": "kInt", ...} from `enum class Kind` in codec.h, so names follow the C++."""
  m = re.search(r"enum class Kind[^{]*\{([^}]*)\}", header.read_text())
  return dict((v, k) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", m.group(1))) if m else {}


def short_name(demangled: str, kinds: dict[str, str]) -> str:
  """`void ns::(anonymous namespace)::K<(ns::Kind)2, true>(args)` -> `K<kInt, true>`."""
  s = re.sub(r"\([\w:]*Kind\)(\d+)", lambda m: kinds.get(m.group(1), m.group(0)), demangled)
  s = re.sub(r"^void ", "", s)
  depth, cut = 0, len(s)
  for k, ch in enumerate(s):  # the parameter list is the last top-level "(...)"
    depth += {"<": 1, ">": -1}.get(ch, 0)
    if ch == "(" and depth == 0 and not s.startswith("(anonymous", k):
      cut = k
  s = s[:cut]
  return re.sub(r"^([\w]+::|\(anonymous namespace\)::)+", "", s)


def analyze(sass: str, ptxas: str = "") -> list[KernelReport]:
  """Every kernel's measures from nvdisasm's text and the ptxas report of the same compile."""
  funcs = split_functions(sass)
  res = ptxas_resources(ptxas)
  names = demangle(list(funcs))
  kinds = kind_names()
  out = []
  for mangled, (instrs, labels) in funcs.items():
    k = KernelReport(short_name(names[mangled], kinds), mangled, **res.get(mangled, {}))
    depths, k.loops = loop_depths(instrs, labels)
    k.max_loop_depth = max(depths, default=0)
    for i, d in zip(instrs, depths):
      base, *mods = i.op.split(".")
      # Generic LD/ST count with the global ones: a pointer nvcc cannot place may be global.
      load, store = base in ("LDG", "LDGSTS", "LD"), base in ("STG", "ST")
      hits = {
        "ld128": load and bool({"128", "256"} & set(mods)),
        "st128": store and bool({"128", "256"} & set(mods)),
        "byte_loads": load and bool({"U8", "S8"} & set(mods)),
        "div64": base == "CALL" and any(DIV64.search(t) for t in i.targets),
        "fdiv": base == "CALL" and any(FDIV.search(t) for t in i.targets),
      }
      k.global_loads_in_loops += d > 0 and load
      for what, hit in hits.items():
        if hit:
          setattr(k, what, getattr(k, what) + 1)
          if d > 0:
            setattr(k, f"{what}_in_loops", getattr(k, f"{what}_in_loops") + 1)
    out.append(k)
  # Overloads with one short name keep their whole signature, so each row is one kernel.
  clash = {k.name for k in out if sum(o.name == k.name for o in out) > 1}
  for k in out:
    if k.name in clash:
      k.name = re.sub(r"^void ", "", names[k.mangled])
  return sorted(out, key=lambda k: k.name)


def compare(kernels: list[KernelReport], thresholds: dict) -> list[str]:
  """The failures: a measure past its threshold, a kernel without an entry, a stale entry."""
  entries = thresholds.get("kernels", {})
  bad = []
  for k in kernels:
    entry = entries.get(k.name)
    if entry is None:
      bad.append(
        f"{k.name}: no entry in {THRESHOLDS.name} (add one; `python tools/gpu_sass.py "
        "--update` writes today's values)"
      )
      continue
    for measure, (key, kind) in LIMITS.items():
      if key not in entry:
        continue
      value, limit = getattr(k, measure), entry[key]
      if (value > limit) if kind == "max" else (value < limit):
        word = "above its maximum" if kind == "max" else "below its minimum"
        bad.append(f"{k.name}: {measure} = {value}, {word} {key} = {limit}")
  for name in sorted(set(entries) - {k.name for k in kernels}):
    bad.append(f"{name}: in {THRESHOLDS.name} but not in the compiled code (remove the entry)")
  return bad


def table(kernels: list[KernelReport], thresholds: dict | None = None) -> str:
  """A readable table, one row per kernel, grouped by the role the thresholds file names."""
  entries = (thresholds or {}).get("kernels", {})
  head = ("kernel", "regs", "spill", "loops", "ld128", "st128", "u8 ld", "div64", "fdiv")
  groups: dict[str, list[KernelReport]] = {}
  for k in kernels:
    groups.setdefault(entries.get(k.name, {}).get("role", "(no role)"), []).append(k)
  rows: list[tuple[str, ...]] = []
  for role, ks in sorted(groups.items()):
    rows.append((f"-- {role}",))
    for k in ks:
      rows.append(
        (
          f"  {k.name}",
          str(k.registers),
          str(k.spill_bytes),
          f"{k.loops} d{k.max_loop_depth}",
          f"{k.ld128_in_loops}/{k.ld128}",
          f"{k.st128_in_loops}/{k.st128}",
          f"{k.byte_loads_in_loops}/{k.global_loads_in_loops}",
          str(k.div64_in_loops),
          str(k.fdiv_in_loops),
        )
      )
  w0 = max(len(r[0]) for r in [head, *rows] if len(r) > 1)
  fmt = f"{{:<{w0}}}" + "  {:>7}" * (len(head) - 1)
  lines = [fmt.format(*head)]
  lines += [r[0] if len(r) == 1 else fmt.format(*r) for r in rows]
  lines.append(
    "regs: per thread; spill: bytes stored + loaded; loops: count, deepest nesting; "
    "ld128/st128: 128-bit global accesses in loops / in all; u8 ld: byte-wide global loads "
    "in loops / all global loads in loops; div64, fdiv: 64-bit integer and IEEE float "
    "divisions (or reciprocals) in loops"
  )
  return "\n".join(lines)


def report(compiled: list[gpu_ptx.Compiled]) -> list[KernelReport]:
  """The kernels of every compiled source that has a cubin with code."""
  out = []
  for c in compiled:
    out += analyze(disassemble(c.cubin), c.ptxas)
  return out


def load_thresholds(path: Path = THRESHOLDS) -> dict:
  return json.loads(path.read_text())


def nvcc_release() -> str:
  """nvcc's release ("13.0"): register counts move between releases, so the file names its."""
  exe = gpu_ptx.nvcc()
  out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout if exe else ""
  m = re.search(r"release (\d+\.\d+)", out)
  return m.group(1) if m else "unknown"


def updated(kernels: list[KernelReport], thresholds: dict) -> dict:
  """`thresholds` with every kernel's limits set to today's values (roles and notes kept)."""
  new = dict(thresholds)
  old = thresholds.get("kernels", {})
  new["kernels"] = {}
  for k in kernels:
    entry = {key: v for key, v in old.get(k.name, {}).items() if not key.startswith(("max", "min"))}
    entry.setdefault("role", "(describe the kernel's codec kind and op)")
    for measure, (key, kind) in LIMITS.items():
      if kind == "max" or getattr(k, measure) > 0:  # a minimum only where the kernel has them
        entry[key] = getattr(k, measure)
    new["kernels"][k.name] = entry
  return new


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", type=Path, help="also write the measures and failures here")
  ap.add_argument("--update", action="store_true", help=f"write today's values to {THRESHOLDS}")
  args = ap.parse_args()
  if gpu_ptx.nvcc() is None or nvdisasm() is None:
    print("nvcc or nvdisasm not found: nothing checked")
    return 2
  thresholds = load_thresholds()
  with tempfile.TemporaryDirectory() as d:
    kernels = report(gpu_ptx.compile_all(work=Path(d)))
  release = nvcc_release()
  if args.update:
    thresholds = {**updated(kernels, thresholds), "nvcc": release}
    THRESHOLDS.write_text(json.dumps(thresholds, indent=2) + "\n")
  bad = compare(kernels, thresholds)
  print(table(kernels, thresholds))
  for b in bad:
    print("REGRESSION", b)
  if bad and thresholds.get("nvcc") != release:
    print(f"note: the thresholds were set with nvcc {thresholds.get('nvcc')}, this is {release}")
  print(f"SASS report of {len(kernels)} kernels: {len(bad)} failures")
  if args.json:
    args.json.write_text(
      json.dumps({"kernels": [dataclasses.asdict(k) for k in kernels], "failures": bad}, indent=2)
    )
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
