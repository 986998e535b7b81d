"""Compressors for jcoccl's collectives (public API).

Example:
  >>> import jax.numpy as jnp
  >>> from jcoccl import compressors as jc
  >>> c = jc.parse("int8:block=128")
  >>> x = jnp.linspace(-1, 1, 1000)
  >>> x_hat = c.decode(c.encode(x))
  >>> bool(jnp.all(jnp.abs(x - x_hat) <= c.error_bound(x)))
  True
"""

from jcoccl._src.compressors import CastCompressor as CastCompressor
from jcoccl._src.compressors import CheckResult as CheckResult
from jcoccl._src.compressors import Compressor as Compressor
from jcoccl._src.compressors import ErrorBoundedCompressor as ErrorBoundedCompressor
from jcoccl._src.compressors import Fp8Compressor as Fp8Compressor
from jcoccl._src.compressors import HadamardCompressor as HadamardCompressor
from jcoccl._src.compressors import IntCompressor as IntCompressor
from jcoccl._src.compressors import NoneCompressor as NoneCompressor
from jcoccl._src.compressors import Payload as Payload
from jcoccl._src.compressors import Plugin as Plugin
from jcoccl._src.compressors import PluginReplacedWarning as PluginReplacedWarning
from jcoccl._src.compressors import SpikeCompressor as SpikeCompressor
from jcoccl._src.compressors import cast as cast
from jcoccl._src.compressors import check as check
from jcoccl._src.compressors import error_bounded as error_bounded
from jcoccl._src.compressors import fp8 as fp8
from jcoccl._src.compressors import hadamard as hadamard
from jcoccl._src.compressors import int2 as int2
from jcoccl._src.compressors import int3 as int3
from jcoccl._src.compressors import int4 as int4
from jcoccl._src.compressors import int5 as int5
from jcoccl._src.compressors import int6 as int6
from jcoccl._src.compressors import int7 as int7
from jcoccl._src.compressors import int8 as int8
from jcoccl._src.compressors import load_plugin as load_plugin
from jcoccl._src.compressors import none as none
from jcoccl._src.compressors import parse as parse

# Codecs of your own (docs/custom_compressors.md); their native kernels come from plugin
# libraries: load_plugin, Plugin (jcoccl/include/jcoccl/codec_plugin.h).
from jcoccl._src.compressors import register as register
from jcoccl._src.compressors import registered as registered
from jcoccl._src.compressors import spike as spike
from jcoccl._src.compressors import unregister as unregister
from jcoccl._src.compressors.sources import import_codecs as import_codecs
