"""Low-level access to jcoccl's native extensions, for diagnostics and GPU tooling.

Most users never need this module: the collectives and ``Compressor`` methods choose the
native kernels themselves. It exposes what checking a build or a GPU needs: the extension
modules, their FFI registration, the C++ enum tables, the codecs' kernel attributes and row
calls, and one raw call of the fused engine.

Example:
  >>> from jcoccl import native
  >>> native.module("cpu") is not None
  True
  >>> native.codes("CODEC_KINDS")["int"]
  2
"""

from jcoccl._src.compressors.native import available as available
from jcoccl._src.compressors.native import codec_attrs as codec_attrs
from jcoccl._src.compressors.native import codec_text as codec_text
from jcoccl._src.compressors.native import decode_rows as decode_rows
from jcoccl._src.compressors.native import decode_sum as decode_sum
from jcoccl._src.compressors.native import decode_sum_encode as decode_sum_encode
from jcoccl._src.compressors.native import encode_rows as encode_rows
from jcoccl._src.engine.fused_ffi import engine_call as engine_call
from jcoccl._src.native._ffi import codes as codes
from jcoccl._src.native._ffi import native_import_error as import_error
from jcoccl._src.native._ffi import native_module as module
from jcoccl._src.native._ffi import register as register
