"""Every use of JAX internals (anything outside jax's public API) lives in this module.

When JAX moves an internal, this is the one file to change. Import from here, never
from ``jax._src`` elsewhere in jcoccl.
"""

from __future__ import annotations
