"""``python -m jcoccl.launch``: run N processes of one program on this machine, as N hosts.

    python -m jcoccl.launch -n 4 [--devices-per-process K] [--link-rate 1gbit] -- python train.py

Each process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (read by
:func:`jcoccl.distributed.initialize`, which calls ``jax.distributed.initialize``) and, on
CPU, K host devices. Their output is streamed line by line with a ``[rank]`` prefix. The
launcher exits with the first non-zero exit status of any process; once one process has
failed, the others get ``--kill-after`` seconds to stop by themselves, then are terminated.
Ctrl-C or SIGTERM of the launcher sends SIGTERM to every process and gives it as long to stop
(``python -m models.train`` saves a checkpoint at the step reached); a second one hurries it.

``--link-rate`` runs every process in a fresh network namespace whose loopback device is
shaped with ``tc`` (a token bucket of that rate): all traffic between the processes, which
stays on 127.0.0.1, then shares one link of that rate, as processes on different hosts share
a network. ``--link-delay`` adds a one-way delay per packet (netem). The namespace is removed
when the launcher exits, on error or Ctrl-C too. Shaping needs root (CAP_NET_ADMIN) and
iproute2's ``ip`` and ``tc``.

Programs written for jcoccl do not depend on this launcher: on a cluster, start one process
per host with SLURM / Open MPI (JAX detects them) or set the three variables yourself.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import IO

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bits(text: str) -> float:
  """Bits per second of a tc rate such as ``1gbit`` or ``500mbit``.

  Raises:
    ValueError: not a positive rate with a unit of bit, kbit, mbit, gbit or tbit.
  """
  m = _RATE.match(text.strip())
  if not m or float(m.group(1)) <= 0:
    raise ValueError(
      f"--link-rate must be a positive rate such as 1gbit, 500mbit or 10gbit, got {text!r}"
    )
  return float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]


def check_delay(text: str) -> str:
  """Validates a tc delay such as ``100us`` or ``2ms``; returns it."""
  m = _DELAY.match(text.strip())
  if not m:
    raise ValueError(f"--link-delay must be a time such as 100us, 2ms or 0.5s, got {text!r}")
  return text.strip()


class LinkNamespace:
  """A network namespace whose loopback is shaped to one shared link; removed on close.

  Example:
    >>> with LinkNamespace(rate="1gbit") as ns:      # doctest: +SKIP
    ...   subprocess.run(ns.wrap(["python", "-c", "..."]))
  """

  def __init__(self, rate: str | None = None, delay: str | None = None):
    self.rate, self.delay = rate, delay
    self.name = f"jcoccl-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    self.created = False

  def wrap(self, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` inside the namespace."""
    return ["ip", "netns", "exec", self.name, *argv]

  def __enter__(self) -> LinkNamespace:
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
      why = f"{' and '.join(missing)} not found" if missing else "not running as root"
      raise PermissionError(
        f"--link-rate/--link-delay shape a private network namespace, which needs root "
        f"(CAP_NET_ADMIN) and iproute2's ip and tc ({why}); run as root, or leave the link "
        f"unshaped"
      )
    # Marked first: an interrupt that lands while `ip netns add` is finishing must still
    # remove the namespace (deleting one that was never made is harmless).
    self.created = True
    try:
      self._run(["ip", "netns", "add", self.name])
      self._run(self.wrap(["ip", "link", "set", "lo", "up"]))
      parent = ["root"]
      if self.rate:
        # The bucket must hold at least one 64 KiB loopback packet and ~4 ms of traffic.
        burst = max(512 * 1024, int(rate_bits(self.rate) / 8 * 0.004))
        self._run(
          self.wrap(
            [
              "tc",
              "qdisc",
              "add",
              "dev",
              "lo",
              "root",
              "handle",
              "1:",
              "tbf",
              "rate",
              self.rate,
              "burst",
              str(burst),
              "latency",
              "400ms",
            ]
          )
        )
        parent = ["parent", "1:1"]
      if self.delay:
        self._run(
          self.wrap(
            [
              "tc",
              "qdisc",
              "add",
              "dev",
              "lo",
              *parent,
              "handle",
              "10:",
              "netem",
              "delay",
              self.delay,
            ]
          ),
          hint="--link-delay needs the netem qdisc (kernel module sch_netem)",
        )
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Removes the namespace (idempotent)."""
    if self.created:
      # A second Ctrl-C must not cut the removal short.
      blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
      try:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        self.created = False
      finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

  @staticmethod
  def _run(argv: list[str], hint: str = "") -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
      msg = f"{' '.join(argv)} failed: {r.stderr.strip() or r.stdout.strip()}"
      raise RuntimeError(f"{msg}; {hint}" if hint else msg)


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(rank: int, n: int, port: int, devices: int, link: str) -> dict[str, str]:
  """The environment of process ``rank`` of ``n``."""
  env = dict(os.environ)
  env.update(
    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
    JAX_NUM_PROCESSES=str(n),
    JAX_PROCESS_ID=str(rank),
    JCOCCL_LINK=link,
    PYTHONUNBUFFERED="1",
  )
  # Transparent huge pages for every large malloc (glibc >= 2.35; older ones ignore it).
  # XLA maps each result above 32 MiB afresh, and with 4 KiB pages the faults of such
  # buffers, interleaved with other large ones, made a 4-process int8 all_gather at 1 Gbit/s
  # swing between 427 and 635 ms; with huge pages it held at 427 (the lax op: unchanged).
  env.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  return env


def _pump(rank: int, stream: IO[str], lock: threading.Lock) -> None:
  for line in stream:
    with lock:
      sys.stdout.write(f"[{rank}] {line}")
      sys.stdout.flush()


def run(
  argv: Sequence[str],
  n: int,
  *,
  devices: int = 1,
  link_rate: str | None = None,
  link_delay: str | None = None,
  kill_after: float = 30.0,
) -> int:
  """Runs ``argv`` as ``n`` processes; returns the first non-zero exit status, else 0.

  Args:
    argv: the command every process runs.
    n: number of processes.
    devices: host CPU devices per process (XLA_FLAGS).
    link_rate: tc rate of the shared loopback link (None: unshaped, no namespace).
    link_delay: tc netem delay per packet (None: none).
    kill_after: seconds the others may take to stop once one process has failed.

  Returns:
    0, or the exit status of the first process that failed (128 + signal if killed).
  """
  ns = LinkNamespace(link_rate, link_delay) if (link_rate or link_delay) else None
  link = f"rate={link_rate or 'unshaped'} delay={link_delay or '0'}"
  procs: list[subprocess.Popen] = []
  lock = threading.Lock()

  def stop(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")

  old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    if ns is not None:
      ns.__enter__()
    port = free_port()
    cmd = ns.wrap(argv) if ns else list(argv)
    pumps = []
    for rank in range(n):
      p = subprocess.Popen(
        cmd,
        env=process_env(rank, n, port, devices, link),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
      )
      procs.append(p)
      t = threading.Thread(target=_pump, args=(rank, p.stdout, lock), daemon=True)
      t.start()
      pumps.append(t)
    status = _wait(procs, kill_after, lock)
    for t in pumps:
      t.join(timeout=5)
    return status
  except KeyboardInterrupt:
    # Ctrl-C or SIGTERM of the launcher: each process gets SIGTERM and kill_after seconds to
    # stop by itself (python -m models.train saves a checkpoint first). A second signal
    # ends the wait; the SIGTERM sent again below then stops them at once.
    try:
      _terminate(procs, grace_s=kill_after)
    except KeyboardInterrupt:
      pass
    return 130
  finally:
    _terminate(procs)
    for s, h in old.items():
      signal.signal(s, h)
    if ns is not None:
      ns.close()


def _exit_status(rc: int) -> int:
  return 128 - rc if rc < 0 else rc


def _wait(procs: list[subprocess.Popen], kill_after: float, lock: threading.Lock) -> int:
  status, deadline = 0, None
  while True:
    codes = [p.poll() for p in procs]
    for rank, rc in enumerate(codes):
      if rc not in (None, 0) and status == 0:
        status = _exit_status(rc)
        deadline = time.monotonic() + kill_after
        with lock:
          print(
            f"jcoccl.launch: process {rank} exited with status {status}; the others get "
            f"{kill_after:g} s to stop",
            file=sys.stderr,
            flush=True,
          )
    if all(rc is not None for rc in codes):
      return status
    if deadline is not None and time.monotonic() > deadline:
      _terminate(procs)
      return status
    time.sleep(0.05)


def _terminate(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
  """SIGTERM to each live process group, then SIGKILL after ``grace_s`` seconds."""
  live = [p for p in procs if p.poll() is None]
  for p in live:
    _signal_group(p, signal.SIGTERM)
  end = time.monotonic() + grace_s
  for p in live:
    try:
      p.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      _signal_group(p, signal.SIGKILL)
      p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(p.pid, sig)
  except ProcessLookupError:
    pass


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point (see the module docstring)."""
  p = argparse.ArgumentParser(
    prog="python -m jcoccl.launch",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
  p.add_argument(
    "--devices-per-process", type=int, default=1, help="host CPU devices per process (default 1)"
  )
  p.add_argument("--link-rate", help="shape the processes' shared link, e.g. 1gbit, 10gbit")
  p.add_argument("--link-delay", help="one-way delay per packet on that link, e.g. 100us")
  p.add_argument(
    "--kill-after",
    type=float,
    default=30.0,
    help="seconds the others get to stop once one process failed (default 30)",
  )
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program to run")
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("give the program after --, e.g. -- python -m models.train")
  if args.processes < 1:
    p.error(f"--processes must be >= 1, got {args.processes}")
  if args.devices_per_process < 1:
    p.error(f"--devices-per-process must be >= 1, got {args.devices_per_process}")
  if not args.kill_after >= 0:
    p.error(f"--kill-after must be >= 0 seconds, got {args.kill_after}")
  try:
    if args.link_rate:
      rate_bits(args.link_rate)
    if args.link_delay:
      check_delay(args.link_delay)
    return run(
      command,
      args.processes,
      devices=args.devices_per_process,
      link_rate=args.link_rate,
      link_delay=args.link_delay,
      kill_after=args.kill_after,
    )
  except (ValueError, PermissionError, RuntimeError) as e:
    p.error(str(e))
    return 2


if __name__ == "__main__":
  sys.exit(main())
