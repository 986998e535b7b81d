"""jcoccl: compressed collectives for JAX.

Compression-aware all_reduce, all_gather, reduce_scatter, all_to_all and ppermute,
used inside ``jax.shard_map`` with the same arguments as their ``jax.lax`` counterparts
plus a ``compressor``.
"""

from jcoccl._src.info import info as info

__version__ = "0.1.0"
