"""Error-feedback state kept between steps: one float32 residual per device and leaf.

``init`` builds it outside ``jax.shard_map`` (stacked over the devices that own one);
inside, ``local`` gives the ops their ``residual=`` and ``stacked`` puts the new ones back.

Example:
  >>> import jcoccl
  >>> state = jcoccl.residuals.init(params, mesh, "data")   # doctest: +SKIP
"""

from jcoccl._src.ops.residuals import init as init
from jcoccl._src.ops.residuals import local as local
from jcoccl._src.ops.residuals import stacked as stacked
