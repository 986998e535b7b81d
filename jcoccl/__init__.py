"""jcoccl: compressed collectives for JAX.

Compression-aware all_reduce, all_gather, reduce_scatter, all_to_all and ppermute,
used inside ``jax.shard_map`` with the same arguments as their ``jax.lax`` counterparts
plus a ``compressor``.
"""

from jcoccl._src.observability.info import __version__ as __version__
from jcoccl._src.observability.info import info as info

# Building codec plugins: the C header and the CMake package shipped with jcoccl.
from jcoccl._src.observability.info import get_include as get_include
from jcoccl._src.observability.info import get_cmake_dir as get_cmake_dir

# Collectives (used inside jax.shard_map; same arguments as their jax.lax counterparts).
from jcoccl._src.ops.all_reduce import all_reduce as all_reduce
from jcoccl._src.ops.all_gather import all_gather as all_gather
from jcoccl._src.ops.reduce_scatter import reduce_scatter as reduce_scatter
from jcoccl._src.ops.all_to_all import all_to_all as all_to_all
from jcoccl._src.ops.ppermute import ppermute as ppermute
from jcoccl._src.compressors.threshold import set_default_min_bytes as set_default_min_bytes
from jcoccl._src.compressors.threshold import default_min_bytes as default_min_bytes
from jcoccl._src.compressors.threshold import SkippedCompression as SkippedCompression

# Settings captured when a program is traced (part of jit's cache key).
from jcoccl._src.base.config import Config as Config
from jcoccl._src.base.config import config as config
from jcoccl._src.base.config import current as get_config
from jcoccl._src.base.config import set_defaults as set_config_defaults

# all_reduce(algorithm="auto")'s cost model: constants measured per link and backend.
from jcoccl._src.base.cost_model import CostModel as CostModel
from jcoccl._src.base.cost_model import CostModels as CostModels
from jcoccl._src.ops.auto_model import load as load_cost_model
from jcoccl._src.base.cost_model import read as read_cost_model
from jcoccl._src.base.cost_model import save as save_cost_model
from jcoccl._src.ops.auto_model import set_model as set_cost_model
from jcoccl._src.observability.calibrate import calibrate as calibrate
from jcoccl._src.observability.calibrate import choices as cost_model_choices

from jcoccl import compressors as compressors
from jcoccl import distributed as distributed
from jcoccl._src.ops.error_feedback import ErrorFeedback as ErrorFeedback
from jcoccl._src.ops.error_feedback import error_feedback as error_feedback
from jcoccl import residuals as residuals
from jcoccl._src.observability.wire_bytes import wire_bytes as wire_bytes
from jcoccl._src.observability.explain import explain as explain

# Fused backend: jcoccl's own communicators, one custom call per collective.
from jcoccl._src.engine.fused_comms import init as init
from jcoccl._src.engine.fused_comms import shutdown as shutdown

# Per-axis, per-op compression policy (used by models/ for 3D-parallel training).
from jcoccl.policy import Policy as Policy

# Compressed data-parallel gradients inside jit programs sharded by the compiler (GSPMD).
from jcoccl._src.integrations.gspmd import DataParallelGrad as DataParallelGrad
from jcoccl._src.integrations.gspmd import value_and_grad as value_and_grad

# Zero-code-change compression: a program's lax collectives run as jcoccl ops per a policy.
from jcoccl._src.integrations.compress import compress as compress
