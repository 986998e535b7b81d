"""Helpers of the multi-process tests: kill (or signal) one process of a running launch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

# Long enough that a process busy compiling on a loaded 2-core machine still answers.
HEARTBEAT_S = 8


def kill_when_ready(
  cmd: list[str],
  cwd: str,
  pid_line: str,
  ready_line: str,
  ranks: set[int],
  victim: int,
  sig: int = signal.SIGKILL,
) -> tuple[float, str, int]:
  """Starts ``cmd`` (a ``jcoccl.launch`` command line), waits until every rank in ``ranks``
  printed ``ready_line``, sends rank ``victim`` ``sig`` (SIGKILL: kills it) and waits for the
  launch to end.

  The processes declare a silent peer dead after :data:`HEARTBEAT_S` seconds
  (JCOCCL_HEARTBEAT_S) instead of the default 20: the survivors of the kill wait that long,
  idle, before they stop.

  Args:
    cmd: the launcher command.
    cwd: its working directory.
    pid_line: regex of the rank-prefixed line that gives a rank's pid (groups: rank, pid).
    ready_line: regex of the rank-prefixed line that says a rank is ready (group: rank).
    ranks: the ranks to wait for.
    victim: the rank to kill.
    sig: the signal sent to it.

  Returns:
    (seconds from the kill until the launcher exited, its whole output, its exit status).

  Example:
    >>> took, out, rc = kill_when_ready(cmd, ROOT, r"\\[(\\d)\\] pid (\\d+)$",
    ...                                 r"\\[(\\d)\\] step 4$", {0, 1}, 1)
  """
  env = {**os.environ, "JCOCCL_HEARTBEAT_S": str(HEARTBEAT_S)}
  p = subprocess.Popen(
    cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  pids, lines, ready = {}, [], set()
  try:
    assert p.stdout is not None
    for line in p.stdout:
      lines.append(line)
      if m := re.match(pid_line, line.strip()):
        pids[int(m.group(1))] = int(m.group(2))
      if m := re.match(ready_line, line.strip()):
        ready.add(int(m.group(1)))
      if ready >= ranks:
        break
    assert ready >= ranks and victim in pids, "".join(lines)[-4000:]
    os.kill(pids[victim], sig)
    killed = time.monotonic()
    rest, _ = p.communicate(timeout=120)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  return time.monotonic() - killed, "".join(lines) + rest, p.returncode
