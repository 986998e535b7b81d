"""Compressors: the wire formats of cuda/WIRE_FORMAT.md as jnp code (the specification).

A compressor is a frozen, hashable dataclass (usable as a static jit argument and as a
primitive parameter) built by a factory: ``none``, ``cast``, ``int2`` ... ``int8``,
``fp8``, ``hadamard``, ``error_bounded``, or ``parse(spec)``.

Public fields, read by the native glue to map a compressor to kernel attributes:

  ============================  ==================================================================
  class (``kind``)              fields
  ============================  ==================================================================
  NoneCompressor ("none")       (none)
  CastCompressor ("cast")       ``dtype``: numpy dtype bfloat16 or float16
  IntCompressor ("int")         ``bits`` (2 to 8), ``block_size``, ``symmetric`` (bool),
                                ``rounding`` ("nearest" | "stochastic")
  Fp8Compressor ("fp8")         ``fmt`` ("e4m3" | "e5m2"), ``block_size``
  HadamardCompressor            ``inner`` (a Compressor), ``size`` (H); ``rounding`` mirrors inner
    ("hadamard")
  ErrorBoundedCompressor        ``abs_error`` (Python float; the codec uses float32(2*abs_error)
    ("error_bounded")           as step and float32(abs_error) in the check), ``block_size``
  ============================  ==================================================================

Every compressor also has ``kind`` (class constant), ``granule``, ``lossless``, ``name``.

Numerics notes (why the jnp code looks the way it does):
  * XLA rewrites ``a / broadcast(b)`` into ``a * broadcast(1/b)`` (two roundings); divisors are
    materialised behind ``lax.optimization_barrier`` (``_base.div``).
  * XLA:GPU may contract ``a*b + c`` into an FMA; products that are later added pass through
    ``lax.optimization_barrier`` first.
  * XLA:CPU runs with flush-to-zero / denormals-are-zero: float32 subnormals may act as 0.
    Error bounds include absolute terms in units of 2**-126 to cover that on every backend.
"""

# Family modules register themselves with the spec registry on import; this order is the
# order in which error messages list their names.
from jcoccl._src.compressors import error_bounded as _error_bounded_family  # noqa: F401
from jcoccl._src.compressors import fp8 as _fp8_family  # noqa: F401
from jcoccl._src.compressors import hadamard as _hadamard_family  # noqa: F401
from jcoccl._src.compressors import identity as _identity_family  # noqa: F401
from jcoccl._src.compressors import intq as _intq_family  # noqa: F401
from jcoccl._src.compressors import spike as _spike_family  # noqa: F401
from jcoccl._src.compressors._base import Compressor as Compressor
from jcoccl._src.compressors._base import Payload as Payload
from jcoccl._src.compressors.conformance import CheckResult as CheckResult
from jcoccl._src.compressors.conformance import check as check
from jcoccl._src.compressors.error_bounded import ErrorBoundedCompressor as ErrorBoundedCompressor
from jcoccl._src.compressors.factories import cast as cast
from jcoccl._src.compressors.factories import error_bounded as error_bounded
from jcoccl._src.compressors.factories import fp8 as fp8
from jcoccl._src.compressors.factories import hadamard as hadamard
from jcoccl._src.compressors.factories import int2 as int2
from jcoccl._src.compressors.factories import int3 as int3
from jcoccl._src.compressors.factories import int4 as int4
from jcoccl._src.compressors.factories import int5 as int5
from jcoccl._src.compressors.factories import int6 as int6
from jcoccl._src.compressors.factories import int7 as int7
from jcoccl._src.compressors.factories import int8 as int8
from jcoccl._src.compressors.factories import none as none
from jcoccl._src.compressors.factories import spike as spike
from jcoccl._src.compressors.fp8 import Fp8Compressor as Fp8Compressor
from jcoccl._src.compressors.hadamard import HadamardCompressor as HadamardCompressor
from jcoccl._src.compressors.identity import CastCompressor as CastCompressor
from jcoccl._src.compressors.identity import NoneCompressor as NoneCompressor
from jcoccl._src.compressors.intq import IntCompressor as IntCompressor
from jcoccl._src.compressors.plugins import Plugin as Plugin
from jcoccl._src.compressors.plugins import PluginReplacedWarning as PluginReplacedWarning
from jcoccl._src.compressors.plugins import load_plugin as load_plugin
from jcoccl._src.compressors.registry import register as register
from jcoccl._src.compressors.registry import registered as registered
from jcoccl._src.compressors.registry import unregister as unregister
from jcoccl._src.compressors.spec import parse as parse
from jcoccl._src.compressors.spike import SpikeCompressor as SpikeCompressor
