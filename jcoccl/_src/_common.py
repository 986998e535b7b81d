"""The collectives' shared helpers, re-exported by name from the modules that own them
(one module per concern):

  :mod:`jcoccl._src.axes`             axis names, group sizes, varying-axes typing, keys
  :mod:`jcoccl._src.compressor_args`  compressors resolved, float dtypes, chunks, tiled
  :mod:`jcoccl._src.threshold`        ``min_bytes`` and :class:`SkippedCompression`
  :mod:`jcoccl._src.payloads`         codec calls and payload gathers (xla backend)
  :mod:`jcoccl._src.auto_model`       the cost model in use (``choose_all_reduce``)

How a message becomes padded, sliced rows is :mod:`jcoccl._src.layout`'s.
"""

from __future__ import annotations

from jcoccl._src.auto_model import choose_all_reduce as choose_all_reduce
from jcoccl._src.axes import AxisNameError as AxisNameError
from jcoccl._src.axes import canonical_axes as canonical_axes
from jcoccl._src.axes import ensure_varying as ensure_varying
from jcoccl._src.axes import group_size as group_size
from jcoccl._src.axes import match_vma as match_vma
from jcoccl._src.axes import off_mesh as off_mesh
from jcoccl._src.axes import rank_key as rank_key
from jcoccl._src.axes import vma_of as vma_of
from jcoccl._src.compressor_args import SAME as SAME
from jcoccl._src.compressor_args import canonical_args as canonical_args
from jcoccl._src.compressor_args import check_chunks as check_chunks
from jcoccl._src.compressor_args import check_dtype as check_dtype
from jcoccl._src.compressor_args import compression_ratio as compression_ratio
from jcoccl._src.compressor_args import grad_for as grad_for
from jcoccl._src.compressor_args import is_float as is_float
from jcoccl._src.compressor_args import is_lone_array as is_lone_array
from jcoccl._src.compressor_args import resolve_compressor as resolve_compressor
from jcoccl._src.compressor_args import resolve_grad_compressor as resolve_grad_compressor
from jcoccl._src.payloads import GATHERS as GATHERS
from jcoccl._src.payloads import decode_rows as decode_rows
from jcoccl._src.payloads import decode_sum as decode_sum
from jcoccl._src.payloads import decode_sum_encode as decode_sum_encode
from jcoccl._src.payloads import encode_rows as encode_rows
from jcoccl._src.payloads import gather_decode as gather_decode
from jcoccl._src.payloads import gather_method as gather_method
from jcoccl._src.threshold import _SKIP_WARNED as _SKIP_WARNED
from jcoccl._src.threshold import SkippedCompression as SkippedCompression
from jcoccl._src.threshold import default_min_bytes as default_min_bytes
from jcoccl._src.threshold import effective_compressor as effective_compressor
from jcoccl._src.threshold import set_default_min_bytes as set_default_min_bytes
from jcoccl._src.threshold import skip_reason as skip_reason
from jcoccl._src.threshold import warn_default_threshold as warn_default_threshold
