"""Every use of JAX internals (anything outside jax's public API) lives in this module.

When JAX moves an internal, this is the one file to change. Import from here, never
from ``jax._src`` elsewhere in jcoccl.
"""

from __future__ import annotations

import contextvars as _contextvars

import jax as _jax
from jax._src import config as _jax_config

# --- collectives: shard_map varying-axes (vma) introspection -------------------------------


def check_vma_enabled() -> bool:
  """True while tracing inside a ``jax.shard_map(..., check_vma=True)`` body."""
  return bool(_jax_config._check_vma.value)


def varying_axes(x) -> frozenset:
  """The manual mesh axes over which ``x``'s value varies (empty outside check_vma)."""
  aval = _jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is None:
    return frozenset(getattr(aval, "vma", frozenset()))
  return frozenset(mat.varying)


def is_traced(*xs) -> bool:
  """True when any of ``xs`` is a tracer (inside jit, grad, vmap, shard_map...)."""
  from jax._src import core as _core

  return any(isinstance(x, _core.Tracer) for x in xs)


# --- fused engine: result types with varying axes; the traced shard_map's devices;
# --- jax.distributed key-value store --------------------------------------------------------


def shape_dtype_with_vma(shape, dtype, vma) -> _jax.ShapeDtypeStruct:
  """A ShapeDtypeStruct whose value varies over the manual axes ``vma`` (for ffi_call
  results inside ``shard_map(check_vma=True)``, which do not inherit the inputs' axes)."""
  from jax._src import core as _core

  sharding = _core.get_cur_mesh_sharding(_jax.P(*([None] * len(shape))))
  return _jax.ShapeDtypeStruct(
    shape, dtype, sharding=sharding, manual_axis_type=_core.ManualAxisType(varying=frozenset(vma))
  )


def shard_map_mesh():
  """The concrete ``jax.sharding.Mesh`` of the innermost ``jax.shard_map``, where JAX's own
  context holds it.

  In order: the mesh of the shard_map being lowered (its lowering context); the mesh of an
  eager shard_map (its trace, the current one); the mesh set with ``jax.set_mesh`` when its
  axis names and sizes are those of the abstract mesh in context. Under ``jax.jit`` a
  shard_map over an explicit mesh stages its body with the abstract mesh only (axis names
  and sizes): the devices are then unknown until lowering, and None is returned.

  Returns:
    The Mesh, or None.
  """
  from jax._src import core as _core
  from jax._src import mesh as _mesh

  lowering = _lowering_mesh.get()
  if isinstance(lowering, _mesh.Mesh) and not lowering.empty:
    return lowering
  trace_mesh = getattr(_core.trace_ctx.trace, "mesh", None)
  if isinstance(trace_mesh, _mesh.Mesh) and not trace_mesh.empty:
    return trace_mesh
  ctx = _mesh.get_concrete_mesh()
  if ctx is None or ctx.empty:
    return None
  return ctx if same_axes(ctx, _mesh.get_abstract_mesh()) else None


def context_abstract_mesh():
  """The abstract mesh in context (axis names and sizes), or None outside any mesh."""
  m = _jax.sharding.get_abstract_mesh()
  return None if m is None or m.empty else m


def same_axes(a, b) -> bool:
  """True when meshes ``a`` and ``b`` (concrete or abstract) have the same axis names and
  sizes, in order."""
  if a is None or b is None:
    return False
  return tuple(a.axis_names) == tuple(b.axis_names) and tuple(a.axis_sizes) == tuple(b.axis_sizes)


_mesh_guard_p = None


def mesh_guard(x, key, check):
  """``x`` unchanged, after a compile-time check of the mesh the program runs on.

  An identity primitive (no HLO is emitted) whose lowering rule calls
  ``check(mesh, key)`` with the concrete mesh of the enclosing shard_map's lowering (None
  if there is none) and raises ValueError with the string it returns. Trace-time checks
  cannot see everything: JAX reuses traced sub-functions (an inner ``jax.jit``, a scan
  body) between shard_maps whose meshes have the same axis names and sizes but other
  devices, and lowering is where the devices are always known.

  Args:
    x: any array.
    key: hashable description of the expected mesh.
    check: ``check(mesh, key) -> str | None``, a hashable (e.g. module-level) function.

  Returns:
    ``x``.
  """
  global _mesh_guard_p
  if _mesh_guard_p is None:
    _mesh_guard_p = _make_mesh_guard()
  return _mesh_guard_p.bind(x, key=key, check=check)


def _make_mesh_guard():
  from jax._src import mesh as _mesh
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching, mlir

  p = Primitive("jcoccl_mesh_guard")
  p.def_impl(lambda x, **_: x)
  p.def_abstract_eval(lambda aval, **_: aval)

  def lower(ctx, x, *, key, check):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if not isinstance(mesh, _mesh.Mesh) or mesh.empty:
      mesh = None
    reason = check(mesh, key)
    if reason is not None:
      raise ValueError(reason)
    return [x]

  mlir.register_lowering(p, lower)
  batching.primitive_batchers[p] = lambda args, dims, **kw: (p.bind(args[0], **kw), dims[0])
  ad.primitive_jvps[p] = lambda primals, tangents, **kw: (p.bind(primals[0], **kw), tangents[0])
  ad.primitive_transposes[p] = lambda ct, x, **kw: [ct]
  return p


def _kv_client():
  from jax._src import distributed as _dist

  client = _dist.global_state.client
  if client is None:
    raise RuntimeError(
      "jax.distributed is not initialised: call jax.distributed.initialize() "
      "in every process before jcoccl.init(mesh)"
    )
  return client


def kv_set(key: str, value: str) -> None:
  """Stores ``value`` under ``key`` in jax.distributed's key-value store."""
  _kv_client().key_value_set(key, value)


def kv_get(key: str, timeout_ms: int) -> str:
  """Waits (at most ``timeout_ms``) for ``key`` in jax.distributed's key-value store."""
  return _kv_client().blocking_key_value_get(key, timeout_ms)


# --- wire bytes: the device assignment of a compiled program --------------------------------


def executable_device_ids(compiled) -> list[int] | None:
  """Device ids of a ``jax.stages.Compiled`` in logical (partition) order, or None.

  HLO replica groups name logical ids; this maps them to ``jax.Device.id``. Only the
  devices of this process are listed, so multi-process programs return None.
  """
  try:
    devices = compiled.runtime_executable().local_devices()
  except Exception:
    return None
  return [d.id for d in devices]


def lowered_device_ids(lowered) -> list[int] | None:
  """Device ids of a ``jax.stages.Lowered`` in logical order, without compiling it; None
  where this JAX keeps its device assignment elsewhere.

  ``executable_device_ids`` gives the same list once the program is compiled, which costs a
  whole XLA compile when only the lowered program's text is read.
  """
  devices = getattr(getattr(lowered, "_lowering", None), "_device_list", None)
  if devices is None:
    return None
  return [d.id for d in devices]


# --- compress: tracing a rewritten sub-program to a closed jaxpr of given input types --------


def trace_closed_jaxpr(fn, in_avals, name: str = "jcoccl_compress"):
  """``fn`` (flat arrays -> list of arrays) traced at ``in_avals`` into a ClosedJaxpr.

  ``jax.make_jaxpr`` takes example values and drops what an abstract value holds beyond
  shape and dtype (inside ``shard_map(check_vma=True)``: the axes it varies over); the
  sub-programs of scan, while, cond and jit equations must keep their input types exactly,
  so the tracing entry point under make_jaxpr is used directly.
  """
  from jax._src import api_util as _api_util
  from jax._src import linear_util as _lu
  from jax._src.interpreters import partial_eval as _pe

  dbg = _api_util.debug_info(name, fn, tuple(in_avals), {})
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(_lu.wrap_init(fn, debug_info=dbg), list(in_avals))
  # In JAX 0.11.2 a Jaxpr carries its constants and ClosedJaxpr is only an alias of it,
  # which 0.12 removed; with_consts (in both) is what the alias's constructor did.
  return jaxpr.with_consts(consts)


# --- collectives as primitives: definition, abstract evaluation, lowering, AD, batching ------


# The concrete mesh of the shard_map whose body is being lowered, set by the collectives'
# lowering rules (the trace-time frames shard_map_mesh reads are gone by then).
_lowering_mesh: _contextvars.ContextVar = _contextvars.ContextVar(
  "jcoccl_lowering_mesh", default=None
)


# The platforms ("cpu", "cuda", ...) that collective is being lowered for.
_lowering_platforms: _contextvars.ContextVar = _contextvars.ContextVar(
  "jcoccl_lowering_platforms", default=None
)


def lowering_collective() -> bool:
  """True while one of jcoccl's collective primitives is being lowered."""
  return _lowering_mesh.get() is not None


def lowering_platforms() -> tuple[str, ...] | None:
  """The platforms the collective primitive being lowered is lowered for (one, except for
  a multi-platform export), or None outside such a lowering."""
  return _lowering_platforms.get()


def new_primitive(name: str):
  """A ``jax.extend.core.Primitive`` named ``name``."""
  from jax.extend.core import Primitive

  return Primitive(name)


def collective_aval(aval, shape, vma, reduced_axes=()):
  """``aval`` reshaped to ``shape``, varying over ``vma``, and no longer unreduced over
  ``reduced_axes`` (the axes a sum ran over); other attributes kept."""
  mat = getattr(aval, "mat", None)
  if mat is None:
    return aval.update(shape=tuple(shape), weak_type=False)
  unreduced = frozenset(mat.unreduced) - set(reduced_axes)
  if unreduced != mat.unreduced:
    kind = mat.unreduced_kind if unreduced else None
    mat = mat.update(varying=frozenset(vma), unreduced=unreduced, unreduced_kind=kind)
  else:
    mat = mat.update(varying=frozenset(vma))
  return aval.update(shape=tuple(shape), weak_type=False, manual_axis_type=mat)


def unreduced_axes(x) -> frozenset:
  """The manual mesh axes over which ``x`` is unreduced (a partial sum per device)."""
  mat = getattr(_jax.typeof(x), "mat", None)
  return frozenset(mat.unreduced) if mat is not None else frozenset()


_unreduced_vary_p = None


def unreduced_as_varying(x, axes):
  """``x`` (unreduced over ``axes``) retyped varying over them: each device's partial
  value is its own operand of the compressed sum. Only used inside the lowering of
  jcoccl's all_reduce (no AD or batching rule: it never appears in a user's jaxpr)."""
  global _unreduced_vary_p
  if _unreduced_vary_p is None:
    from jax.interpreters import mlir

    p = new_primitive("jcoccl_unreduced_as_varying")

    def abstract(aval, *, axes):
      mat = aval.mat
      unreduced = frozenset(mat.unreduced) - set(axes)
      mat = mat.update(
        varying=frozenset(mat.varying) | set(axes),
        unreduced=unreduced,
        unreduced_kind=mat.unreduced_kind if unreduced else None,
      )
      return aval.update(manual_axis_type=mat)

    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, lambda ctx, x, *, axes: [x])
    _unreduced_vary_p = p
  return _unreduced_vary_p.bind(x, axes=tuple(axes))


def aval_vma(aval) -> frozenset:
  """The varying manual axes of an abstract value."""
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def aval_unreduced_only(aval) -> frozenset:
  """The manual axes an abstract value is unreduced over."""
  mat = getattr(aval, "mat", None)
  return frozenset(mat.unreduced) if mat is not None else frozenset()


def aval_unreduced(aval) -> frozenset:
  """The manual axes an abstract value is unreduced over, or (a transpose rule's
  cotangent type of an unreduced input) reduced over."""
  mat = getattr(aval, "mat", None)
  return frozenset(mat.unreduced) | frozenset(mat.reduced) if mat is not None else frozenset()


def define_collective(p, *, abstract_eval, lower, jvp, transpose, batch) -> None:
  """Registers the rules of collective primitive ``p``.

  Args:
    p: the primitive.
    abstract_eval: ``(*avals, **params) -> (out_avals, axes)``; the axes become
      named-axis effects, as for lax's collectives.
    lower: ``(*args, **params) -> outs``, a traceable function lowered in place of ``p``
      (inside shard_map's manual lowering context: axis names bound, check_vma as traced).
    jvp: ``(primals, tangents, **params) -> (outs, tangent_outs)``.
    transpose: ``(cts, *args, **params) -> list of cotangents``.
    batch: ``(args, dims, **params) -> (outs, out_dims)``.

  ``p`` has multiple results (one per array operand: a pytree binds once).
  """
  import functools

  from jax._src import core as _core
  from jax._src import dispatch as _dispatch
  from jax.interpreters import ad, batching, mlir

  def effectful(*avals, **params):
    out, axes = abstract_eval(*avals, **params)
    return out, {_core.NamedAxisEffect(a) for a in axes}

  p.multiple_results = True
  p.def_impl(functools.partial(_dispatch.apply_primitive, p))
  p.def_effectful_abstract_eval(effectful)
  lowered = mlir.lower_fun(lower, multiple_results=True)

  def lowering(ctx, *args, **params):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    platforms = tuple(ctx.platforms or ctx.module_context.platforms)
    token = _lowering_mesh.set(mesh if mesh is not None else False)
    token_p = _lowering_platforms.set(platforms)
    try:
      return lowered(ctx, *args, **params)
    finally:
      _lowering_platforms.reset(token_p)
      _lowering_mesh.reset(token)

  mlir.register_lowering(p, lowering)
  ad.primitive_jvps[p] = jvp
  ad.primitive_transposes[p] = transpose
  batching.primitive_batchers[p] = batch
  if _unreduced_is_high():
    _define_high(p)


def _unreduced_is_high() -> bool:
  """Whether this JAX types a value unreduced over a mesh axis as a high type (JAX >=
  0.12.1: an UnreducedArray). Older JAX has the hooks too but no such type: there they stay
  unset, as setting them changed nothing but the lowering's path (and its timing)."""
  from jax._src import array as _array

  return hasattr(_array, "UnreducedArray")


def _define_high(p) -> None:
  """JAX >= 0.12.1 types a value unreduced over a mesh axis as a high type (an
  UnreducedArray around each device's partial value) and lowers each equation that takes
  one through the primitive's ``to_lojax``. Here that binds ``p`` on the partial values
  themselves (varying over the unreduced axes: each device's partial is its operand, as
  the abstract evaluation of an unreduced input already assumes) and types the results as
  the equation did."""

  def is_high(*avals, **params) -> bool:
    return any(getattr(a, "is_high", False) for a in avals)

  def to_lojax(*hi_vals, **params):
    avals = [_jax.typeof(v) for v in hi_vals]
    out_avals, _ = p.abstract_eval(*avals, **params)
    lo = [a.lower_val(v)[0] for a, v in zip(avals, hi_vals)]
    outs = p.bind(*lo, **params)
    return [a.raise_val(o) for a, o in zip(out_avals, outs)]

  p.is_high = is_high
  p.to_lojax = to_lojax


def define_note(p) -> None:
  """Registers ``p`` as an identity on one array whose parameters only annotate the
  program (as ``checkpoint_name`` does): it lowers to nothing, its tangent and cotangent
  pass through unannotated, and a batch keeps the parameters."""
  from jax.interpreters import ad, batching, mlir

  p.def_impl(lambda x, **_: x)
  p.def_abstract_eval(lambda aval, **_: aval)
  mlir.register_lowering(p, lambda ctx, x, **_: [x])
  ad.primitive_jvps[p] = lambda primals, tangents, **params: (
    p.bind(primals[0], **params),
    tangents[0],
  )
  ad.primitive_transposes[p] = lambda ct, x, **params: [ct]
  batching.primitive_batchers[p] = lambda args, dims, **params: (p.bind(args[0], **params), dims[0])


def is_zero_cotangent(ct) -> bool:
  """True for AD's symbolic zero."""
  from jax.interpreters import ad

  return type(ct) is ad.Zero


def zero_like_aval(aval):
  from jax.interpreters import ad

  return ad.Zero(aval)


def zero_tangent_of(value):
  from jax.interpreters import ad

  # ad.Zero has no from_primal_value in 0.11.2 or 0.12; this is what JAX's own p2tz does.
  return ad.Zero(_jax.typeof(value).to_tangent_aval())


def is_linear_input(x) -> bool:
  """True for a transpose rule's linear (undefined) input, the one that gets a cotangent."""
  from jax.interpreters import ad

  return ad.is_undefined_primal(x)


def undefined_aval(x):
  """The abstract value of a transpose rule's linear (undefined) input."""
  from jax.interpreters import ad

  return x.aval if ad.is_undefined_primal(x) else _jax.typeof(x)


def instantiate_zero(t):
  from jax.interpreters import ad

  return ad.instantiate_zeros(t)


def mesh_axis_names() -> frozenset:
  """The axis names of the mesh in context (abstract, as inside shard_map's trace)."""
  from jax._src import mesh as _mesh

  m = _mesh.get_abstract_mesh()
  return frozenset(() if m is None or m.empty else m.axis_names)
