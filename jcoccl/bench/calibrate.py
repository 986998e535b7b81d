"""``python -m jcoccl.bench calibrate``: measures a cluster's links and codec, writes a model.

Runs :func:`jcoccl.calibrate` on a mesh of every device (``--mesh`` names its axes and
sizes; default one axis "x" over all devices, or ("proc", "local") across processes),
prints what ``algorithm="auto"`` then picks per axis and size, and process 0 writes the
model to ``--out`` (use it with ``JCOCCL_COST_MODEL=FILE`` or ``jcoccl.load_cost_model``).
``--processes`` and ``--link-rate`` start that many processes on a shaped link, as in
``bench collectives``.

Example:
  python -m jcoccl.bench calibrate --out model.json
  python -m jcoccl.bench calibrate --processes 2 --devices-per-process 4 --link-rate 1gbit \
      --other-codec 'hadamard(int4)' --out model_1gbit.json
  python -m jcoccl.bench calibrate --codec mycodecs.py --compressor log8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax
import numpy as np

from jcoccl._src.compressors import sources
from jcoccl._src.observability.calibrate import DEFAULT_SIZES
from jcoccl.bench import _harness as H

NAME = "calibrate"
HELP = "measure each mesh axis and the codec; write auto's cost model (JSON)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Registers the ``calibrate`` subcommand."""
  p = subparsers.add_parser(
    NAME, help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add_arguments(p)
  return p


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--out", default=None, help="write the model to this JSON file")
  p.add_argument(
    "--sizes",
    type=H.size_list,
    default=list(DEFAULT_SIZES),
    help="message sizes (default: jcoccl.calibrate's; the largest must outlast a shaped "
    "link's burst allowance); " + H.SIZE_HELP,
  )
  p.add_argument("--compressor", default="int8", help="codec whose throughput is measured")
  p.add_argument(
    "--other-codec",
    action="append",
    default=[],
    metavar="SPEC",
    help="another codec the program uses, whose throughput is measured too (repeatable)",
  )
  sources.add_codec_flag(p)
  p.add_argument("--mesh", default=None, help="axis=size,... (default: see above)")
  p.add_argument("--iters", type=H.positive_int, default=3, help="timed runs per measurement")
  p.add_argument("--processes", type=int, default=0, help="run as this many processes")
  p.add_argument("--devices-per-process", type=H.positive_int, default=1)
  p.add_argument("--link-rate", default=None, help="with --processes: shaped link rate")


def _mesh(text: str | None) -> jax.sharding.Mesh:
  devs = np.array(jax.devices())
  names: tuple[str, ...]
  shape: tuple[int, ...]
  if text is None:
    if jax.process_count() > 1:
      names, shape = ("proc", "local"), (jax.process_count(), jax.local_device_count())
    else:
      names, shape = ("x",), (devs.size,)
  else:
    try:
      pairs = [kv.split("=") for kv in text.split(",")]
      names, shape = tuple(k.strip() for k, _ in pairs), tuple(int(v) for _, v in pairs)
    except ValueError:
      raise ValueError(f"--mesh must look like data=2,tensor=4, got {text!r}") from None
  if int(np.prod(shape)) != devs.size:
    raise ValueError(
      f"--mesh {dict(zip(names, shape))} needs {np.prod(shape)} devices, have {devs.size}"
    )
  return jax.sharding.Mesh(devs.reshape(shape), names)


def _relaunch(args: argparse.Namespace, argv: list[str]) -> int:
  from jcoccl import launch

  rest, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a in ("--processes", "--link-rate", "--devices-per-process"):
      skip = True
    elif a.split("=", 1)[0] not in ("--processes", "--link-rate", "--devices-per-process"):
      rest.append(a)
  cmd = [sys.executable, "-m", "jcoccl.bench", NAME, *rest]
  return launch.run(cmd, args.processes, devices=args.devices_per_process, link_rate=args.link_rate)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
  """Calibrates, prints auto's choices and the wall time, writes ``--out``."""
  import jcoccl
  from jcoccl import distributed

  sources.import_flagged(args)
  if args.processes < 0:
    raise ValueError(f"--processes must be >= 1, got {args.processes}")
  if args.link_rate is not None and not args.processes:
    raise ValueError("--link-rate shapes the link between processes: give --processes too")
  if args.processes and distributed.environment() is None:
    return _relaunch(args, sys.argv[2:] if argv is None else argv)
  distributed.initialize()
  mesh = _mesh(args.mesh)
  t0 = time.perf_counter()
  models = jcoccl.calibrate(
    mesh, compressor=args.compressor, sizes=args.sizes, iters=args.iters, codecs=args.other_codec
  )
  took = time.perf_counter() - t0
  if jax.process_index() != 0:
    return 0
  report = {
    "seconds": round(took, 3),
    "mesh": dict(mesh.shape),
    "choices": jcoccl.cost_model_choices(models, mesh, args.compressor),
    **{k: v for k, v in models.to_json().items() if k in ("models", "codecs")},
  }
  print(json.dumps(report, indent=1))
  if args.out:
    jcoccl.save_cost_model(models, args.out)
  return 0
