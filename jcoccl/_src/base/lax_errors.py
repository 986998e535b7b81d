"""lax's errors for the calls lax rejects: a jcoccl op is a drop-in for a lax collective, so
a bad argument gets the exception lax raises for the same call, lax's words first and
jcoccl's after (which argument, what is accepted).

The rule: when jcoccl's own checks reject a call, lax is asked about the same call
(:func:`jax.eval_shape` of the lax op on the same arguments: nothing runs). If lax rejects it
too, the error raised is lax's: an instance of lax's exception type whose message begins
with lax's message. If the type jcoccl raised before differs (a ValueError where lax raises
a NameError or a TypeError), the error is an instance of both, so that ``except`` clauses
written for either still catch it. Where lax accepts the call, or fails an internal
assertion (an ``AssertionError`` is no answer to give a user), jcoccl's own error stands.

lax checks a ppermute's pairs only when it lowers the op; jcoccl checks them when it
traces, by lax's rule and with lax's words (:func:`jcoccl._src.ops.ppermute.check_perm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

# What jcoccl's argument checks raise. A failure of another kind is a defect, not an answer
# to the caller, and passes through untouched.
CHECK_ERRORS = (TypeError, ValueError, NameError, IndexError)


def lax_error(lax_call: Callable[[], Any]) -> Exception | None:
  """The exception lax raises, when it traces, for ``lax_call`` (a call of a lax op on the
  caller's arguments); None when lax accepts it or fails an internal assertion.

  Example:
    >>> import jax.numpy as jnp
    >>> lax_error(lambda: jax.lax.psum(jnp.ones(2), "x"))
    NameError('Found an unbound axis name: x. To fix this, please call psum under `jax.shard_map`.')
  """
  try:
    jax.eval_shape(lax_call)
  except AssertionError:
    return None
  except Exception as e:
    return e
  return None


_CLASSES: dict = {}  # (lax's class, jcoccl's) -> the class of both


def error_class(lax_cls: Any, own_cls: Any) -> Any:
  """lax's exception class, also a subclass of ``own_cls`` (what jcoccl raised) when that
  is not one of lax's already; lax's own class when the two cannot be combined.

  Example:
    >>> cls = error_class(IndexError, ValueError)
    >>> cls.__name__, issubclass(cls, IndexError), issubclass(cls, ValueError)
    ('LaxIndexError', True, True)
  """
  if issubclass(own_cls, lax_cls):
    return own_cls
  if (lax_cls, own_cls) not in _CLASSES:
    doc = f"lax's {lax_cls.__name__}, raised by jcoccl, which raised {own_cls.__name__} before."
    try:
      cls = type(f"Lax{lax_cls.__name__}", (lax_cls, own_cls), {"__doc__": doc})
    except TypeError:  # incompatible instance layouts
      cls = lax_cls
    _CLASSES[lax_cls, own_cls] = cls
  return _CLASSES[lax_cls, own_cls]


def hint_of(e: BaseException) -> str:
  """jcoccl's words in ``e``: its ``hint`` when it carries one (the part that is not lax's),
  else its message."""
  return getattr(e, "hint", None) or str(e)


def with_hint(theirs: BaseException, ours: BaseException, op: str) -> BaseException:
  """``theirs`` (lax's error) with jcoccl's words after lax's, typed as :func:`error_class`
  says; the new error keeps jcoccl's words as ``hint``.

  Example:
    >>> e = with_hint(IndexError("tuple index out of range"), ValueError("perm pair (0, 4)"), "ppermute")
    >>> str(e), isinstance(e, IndexError), isinstance(e, ValueError)
    ('tuple index out of range\\n(jcoccl.ppermute: perm pair (0, 4))', True, True)
  """
  hint = hint_of(ours)
  try:
    e = error_class(type(theirs), type(ours))(f"{theirs}\n(jcoccl.{op}: {hint})")
  except Exception:  # a class whose constructor takes more than a message
    return theirs
  e.hint = hint
  return e


@contextlib.contextmanager
def lax_errors(op: str, lax_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
  """Runs jcoccl's argument checks of ``op``; an error they raise becomes lax's error for
  the same call (``lax_fn(*args, **kwargs)``, the arguments as the caller gave them) when
  lax rejects it too (:func:`with_hint`).

  Example:
    >>> with lax_errors("ppermute", jax.lax.ppermute, x, "i", perm):  # doctest: +SKIP
    ...   pairs = check_perm(perm, n)
  """
  try:
    yield
  except CHECK_ERRORS as ours:
    theirs = lax_error(lambda: lax_fn(*args, **kwargs))
    if theirs is None:
      raise
    raise with_hint(theirs, ours, op) from None
