"""The conformance check's result: one :class:`Row` per property, dtype and row length,
gathered in a :class:`CheckResult` (see :mod:`jcoccl._src.compressors.conformance`)."""

from __future__ import annotations

import dataclasses

PROPERTIES = (
  "bound",
  "nonfinite",
  "payload_size",
  "decode_total",
  "decode_in_bounds",
  "native_match",
  "deterministic",
  "decode_sum_order",
)


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the table: a property checked for one dtype.

  Attributes:
    prop: the property (one of ``PROPERTIES``).
    dtype: the input dtype's name, or "-" for checks without one.
    status: "PASS", "FAIL" or "SKIP".
    detail: a short measurement or reason (e.g. "max err/bound 0.502").
    n: the row length the property ran at.
  """

  prop: str
  dtype: str
  status: str
  detail: str
  n: int = 0


@dataclasses.dataclass
class CheckResult:
  """What :func:`check` found: falsy when any property fails.

  Attributes:
    codec: the codec's spec string (or repr).
    rows: every :class:`Row`, in table order.
    seconds: wall time of the whole check.

  Example:
    >>> r = CheckResult("int8", [Row("bound", "float32", "FAIL", "2 violations")])
    >>> bool(r), r.failed("bound")
    (False, True)
  """

  codec: str
  rows: list[Row] = dataclasses.field(default_factory=list)
  seconds: float = 0.0

  @property
  def failures(self) -> list[Row]:
    """The rows whose status is FAIL."""
    return [r for r in self.rows if r.status == "FAIL"]

  def __bool__(self) -> bool:
    return not self.failures

  def status(self, prop: str) -> set[str]:
    """The statuses ``prop`` got over the dtypes, e.g. ``{"PASS", "SKIP"}``."""
    return {r.status for r in self.rows if r.prop == prop}

  def failed(self, prop: str) -> bool:
    """True if ``prop`` failed for at least one dtype."""
    return "FAIL" in self.status(prop)

  def table(self) -> str:
    """The rows as an aligned text table, headed by the codec and a verdict."""
    verdict = "PASS" if self else f"FAIL ({len(self.failures)} failing rows)"
    head = f"check {self.codec}: {verdict} in {self.seconds:.1f} s"
    w = max([len(p) for p in PROPERTIES] + [len(r.prop) for r in self.rows])
    lines = [head, f"  {'property':<{w}}  {'dtype':<8}  {'n':>5}  status  detail"]
    lines += [
      f"  {r.prop:<{w}}  {r.dtype:<8}  {r.n:>5}  {r.status:<6}  {r.detail}" for r in self.rows
    ]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()
