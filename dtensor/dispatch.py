"""``__torch_dispatch__`` for DTensor: specs → rule → redistribute → local op.

Two caches, both keyed by an op schema (the op, the input specs and the
non-tensor arguments):

* the *fast path* (``_fast``): schemas whose operands are DTensors (or
  0-d plain tensors such as wrapped Python numbers) and plain hashable
  values, that need no redistribution on a member rank. A hit builds the key
  in one pass over ``args``, calls the op on the local tensors and wraps the
  result with the cached output spec — no pytree walk, no rule, no meta
  tensors. Detach/alias keep the input's spec object (specs are immutable).
* the *propagation cache* (``_cache``): everything else that a rule covers —
  which placements each input needs and what each output's spec is. A miss
  asks the op family's rule; output metadata comes from the rule's shapes
  (pure shape math) with dtypes from a probe cached per dtype signature, or
  else from the op run on meta tensors of the global shapes.

Ops without a rule still give the single-device answer: inputs become
``Replicate``, the op runs locally and its outputs are ``Replicate``. Ranks
outside an op's mesh never communicate; they get empty outputs of the right
dtype (``None`` for Python scalars).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor.errors import MeshError, ShardingError, UnsupportedOpError
from dtensor.placement import Replicate, format_placements
from dtensor.sharding import OpCall, Sharding
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride, local_block
from dtensor.tensor import DTensor, _device_of, _hooks, _mesh_max, redistribute_local

__all__ = [
    "OpCall",
    "Sharding",
    "dispatch",
    "implicit_replication",
    "register_rule",
]

log = logging.getLogger("dtensor.dispatch")
aten = torch.ops.aten

_state = threading.local()


@contextlib.contextmanager
def implicit_replication():
    """Allow plain (non-scalar) tensors as operands: they count as ``Replicate``.

    Example:
        >>> with implicit_replication():
        ...     y = dt + torch.ones(4)     # the plain tensor is replicated
    """
    old = getattr(_state, "implicit", False)
    _state.implicit = True
    try:
        yield
    finally:
        _state.implicit = old


_rules: dict[Any, Any] = {}
_packet_rules: dict[Any, Any] = {}
_logged_fallback: set = set()


def register_rule(*ops):
    """Decorator: ``rule(call: OpCall) -> Sharding | None`` for these ops.

    ``ops`` may be overloads (``aten.add.Tensor``) or packets (``aten.add``,
    every overload). Returning ``None`` falls back to replication. A rule may
    read the *type* of a float or complex argument but not its value: cached
    results are shared across values (``x * 0.5`` and ``x * 0.25``).

    Example:
        >>> @register_rule(torch.ops.mylib.scale.default)
        ... def scale_rule(call):
        ...     (spec,) = call.specs
        ...     return Sharding(inputs=(None,), outputs=(spec.placements,))
    """

    def wrap(rule):
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                _packet_rules[op] = rule
            else:
                _rules[op] = rule
        return rule

    return wrap


def _rule_for(func):
    rule = _rules.get(func)
    if rule is None:
        rule = _packet_rules.get(func.overloadpacket)
        if rule is None:
            from dtensor.rules import rule_for_tags

            rule = rule_for_tags(func)
        _rules[func] = rule or _NO_RULE
    return None if rule is _NO_RULE else rule


def _NO_RULE(call):  # pragma: no cover - sentinel
    return None


# Metadata-only fast paths: the output is the input's spec, by identity.
def _alias_of_self(func, args, kwargs):
    x = args[0]
    return DTensor(func(x._local_tensor), x._spec, requires_grad=False)


_SPEC_ALIASING = {aten.detach.default, aten.alias.default}


def _unwrap_key(x, specs, locals_, implicit_ok):
    """Replace a DTensor/plain tensor by its spec; remember the local."""
    if isinstance(x, DTensor):
        specs.append(x._spec)
        locals_.append(x)
        return x._spec
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or implicit_ok or x.numel() == 1:
            locals_.append(x)
            specs.append(None)
            return _PlainKey(tuple(x.shape), x.dtype, x.device.type)
        return _Plain(x)
    return x


@dataclass(frozen=True, slots=True)
class _PlainKey:
    shape: tuple
    dtype: torch.dtype
    device: str


class _Plain:
    """A plain tensor that may not be implicitly replicated (error later)."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


@dataclass(frozen=True, slots=True)
class _Entry:
    """Cached propagation result for one op schema."""

    targets: tuple[DTensorSpec | None, ...]  # per operand; None = as is
    out_specs: tuple[DTensorSpec, ...]
    fallback: bool
    scalar_reduce: str | None
    local: Any = None
    # Operands the op writes (in-place self, out=) that were redistributed:
    # their new values are moved back into the operand's own layout.
    write_back: tuple[int, ...] = ()


_cache: dict = {}

# In-place view ops (composites such as matmul of a 1-D operand use them):
# run the out-of-place view, then give self its block, spec and shape.
_INPLACE_VIEWS = {
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.squeeze_.default: aten.squeeze.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


def _inplace_view(func, args, kwargs):
    self = args[0]
    if not isinstance(self, DTensor):
        raise UnsupportedOpError(f"{func}: self must be a DTensor")
    out = dispatch(_INPLACE_VIEWS[func], args, kwargs)
    self._local_tensor = out._local_tensor
    self._spec = out._spec
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        aten.as_strided_.default(self, out._spec.shape, out._spec.stride)
    return self
_RESIZING = {aten.resize_.default, aten.set_.source_Tensor, aten.set_.default}


def _flatten(args, kwargs):
    """(key, operands) where key replaces tensors by specs; fast for flat args."""
    specs: list = []
    operands: list = []
    implicit_ok = getattr(_state, "implicit", False)
    key_args = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key_args.append(_unwrap_key(a, specs, operands, implicit_ok))
        elif isinstance(a, (list, tuple)):
            key_args.append(
                tuple(
                    _unwrap_key(x, specs, operands, implicit_ok)
                    if isinstance(x, torch.Tensor)
                    else x
                    for x in a
                )
            )
        else:
            key_args.append(a)
    key_kwargs = ()
    if kwargs:
        key_kwargs = tuple(
            (
                k,
                _unwrap_key(v, specs, operands, implicit_ok)
                if isinstance(v, torch.Tensor)
                else (
                    tuple(
                        _unwrap_key(x, specs, operands, implicit_ok)
                        if isinstance(x, torch.Tensor)
                        else x
                        for x in v
                    )
                    if isinstance(v, (list, tuple))
                    else v
                ),
            )
            for k, v in kwargs.items()
        )
    return tuple(key_args), key_kwargs, specs, operands


# Fast path ---------------------------------------------------------------------
# A fast entry is (kind, op, out spec, shape, stride, dtype, extra). ``op`` is
# the quickest callable for the overload (``_binding``); kinds: _ONE wraps one
# result with ``spec`` (None: the first operand's spec object), _SELF hands back
# the in-place operand, _MANY wraps a tuple/list with ``spec`` (a tuple of
# specs; ``extra`` its type), _LOCAL runs the rule's ``local`` function
# (``extra``: the function, this rank's coordinate, the output specs).
_ONE, _SELF, _MANY, _LOCAL = range(4)
_fast: dict = {}
_CACHE_LIMIT = 1 << 16  # entries per cache; cleared when full (new shapes forever)
_mk = torch.Tensor._make_wrapper_subclass
_ZERO_D = object()  # key marker: a 0-d plain tensor follows as (dtype, device)
# Non-tensor argument types keyed as (type, value): 2, 2.0 and True are equal
# and hash alike, but give different result dtypes (x ** 2 vs x ** 2.0).
_VALUE_TYPES = frozenset(
    {bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format}
)
# Keyed by type alone: no rule and no result's metadata depends on the value
# of a float or complex scalar (type promotion looks at types only), so
# ``p.add_(g, alpha=-lr)`` with a new ``lr`` every step stays on the fast path.
_SCALAR_TYPES = frozenset({float, complex})


def _key_value(key: list, v, t) -> bool:
    """Append a non-DTensor argument to a fast key; False if it cannot be keyed."""
    if t is list:
        for x in v:
            if type(x) is not int:
                return False
        key.append(tuple(v))
        return True
    if t in _SCALAR_TYPES:
        key.append(t)
        return True
    if t in _VALUE_TYPES:
        key.append(t)
        key.append(v)
        return True
    if t is torch.Tensor and not v.dim():  # a wrapped Python number, say
        key.append(_ZERO_D)
        key.append(v.dtype)
        key.append(v.device)
        return True
    return False


def dispatch(func, args, kwargs):
    """Run ``func`` on DTensor operands: the body of ``DTensor.__torch_dispatch__``."""
    key = [func._op]
    loc = []  # args with every DTensor replaced by its local tensor
    for a in args:
        t = type(a)
        if t is DTensor:
            key.append(a._spec)
            loc.append(a._local_tensor)
        else:
            loc.append(a)
            if t is int or a is None:
                key.append(a)
            elif not _key_value(key, a, t):
                return _dispatch(func, args, kwargs or {}, None)
    if kwargs:
        for k, v in kwargs.items():
            key.append(k)
            t = type(v)
            if t is int or v is None:
                key.append(v)
            elif t is DTensor or not _key_value(key, v, t):
                return _dispatch(func, args, kwargs, None)
    key = tuple(key)
    hit = _fast.get(key)
    if hit is None:
        return _dispatch(func, args, kwargs or {}, key)
    kind, op, spec, shape, stride, dtype, extra = hit
    if kind == _ONE:
        out = op(*loc, **kwargs) if kwargs else op(*loc)
        r = _mk(DTensor, shape, stride, None, None, dtype, out.layout, out.device, False, False)
        r._local_tensor = out
        # spec None: the output's spec is the first operand's (detach, alias,
        # same-shape views): hand over that object itself.
        r._spec = args[0]._spec if spec is None else spec
        return r
    if kwargs is None:
        kwargs = {}
    if kind == _SELF:  # in-place, layout kept: hand back self
        op(*loc, **kwargs)
        return args[0]
    if kind == _LOCAL:
        local, coord, out_specs = extra
        out = local(func, coord, out_specs, tuple(loc), kwargs)
        if isinstance(out, torch.Tensor):
            return _wrap(out, args[0]._spec if spec is None else spec)
        return type(out)(map(_wrap, out, out_specs))
    out = op(*loc, **kwargs)  # _MANY: a tuple or list of tensors
    return extra(map(_wrap, out, spec))


def _wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local, spec)`` without the keyword parsing."""
    meta = spec.tensor_meta
    r = _mk(
        DTensor, meta.shape, meta.stride, None, None, meta.dtype,
        local.layout, local.device, False, False,
    )
    r._local_tensor = local
    r._spec = spec
    return r


def _remember(key, func, args, kwargs, entry: _Entry | None, result) -> None:
    """Add a fast entry for ``key`` if this schema needs no redistribution.

    ``entry`` None: detach/alias (no propagation; the output is the input's spec).
    """
    if entry is not None and (
        entry.fallback
        or entry.write_back
        or not entry.out_specs
        or any(t is not None for t in entry.targets)
    ):
        return
    mesh = next((a._spec.mesh for a in args if type(a) is DTensor), None)
    if mesh is None or mesh.get_coordinate() is None:
        return
    # NOTE: a mesh's membership is fixed for the life of a process (a global
    # rank never changes), so an entry made on a member stays valid.
    single = type(result) is DTensor
    # Same spec as the first operand: later hits hand over *their* operand's
    # spec object (equal in value, since it is part of the key).
    same = single and type(args[0]) is DTensor and result._spec is args[0]._spec
    many = (
        type(result) in (tuple, list)
        and all(type(r) is DTensor for r in result)
        and not _is_inplace(func)
    )
    if len(_fast) >= _CACHE_LIMIT:
        _fast.clear()
    if entry is not None and entry.local is not None:
        if single or many:
            extra = (entry.local, mesh.get_coordinate(), entry.out_specs)
            spec = None if same or not single else result._spec
            _fast[key] = (_LOCAL, None, spec, None, None, None, extra)
        return
    op = _binding(func, args, kwargs)
    if single and result is args[0]:
        if _is_inplace(func):
            _fast[key] = (_SELF, op, None, None, None, None, None)
    elif single:
        spec = result._spec
        meta = spec.tensor_meta
        _fast[key] = (
            _ONE, op, None if same else spec, meta.shape, meta.stride, meta.dtype, None
        )
    elif many and len(result) == len(entry.out_specs):
        _fast[key] = (_MANY, op, entry.out_specs, None, None, None, type(result))


_bindings: dict = {}


def _binding(func, args, kwargs):
    """The quickest callable that runs exactly ``func`` on arguments like ``args``.

    ``torch.ops`` overloads parse their arguments through a generic schema
    path; the generated Python bindings (``torch.add``, ``Tensor.add_``) do
    it ~0.3 µs faster. A binding stands in for ``func`` only where a probe on
    meta tensors records that it calls ``func`` itself, once, with the same
    arguments. Overload resolution depends only on the argument types, so the
    verdict is cached per (op, argument types).
    """
    loc = [a._local_tensor if type(a) is DTensor else a for a in args]
    sig = (func, *map(type, loc), *((k, type(v)) for k, v in kwargs.items()))
    op = _bindings.get(sig)
    if op is None:
        if torch._C._len_torch_dispatch_stack():  # tracing: no probes now
            return func._op
        op = _bindings[sig] = _probe_binding(func, loc, kwargs)
    return op


class _Record(TorchDispatchMode):
    """Records the ops that reach the dispatcher (and runs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _same(a, b) -> bool:
    """Same tensors (by identity) and same values of the same types."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _probe_binding(func, loc, kwargs):
    if not all(type(x) is torch.Tensor for x in loc if isinstance(x, torch.Tensor)):
        return func._op
    margs = [
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.Tensor)
        else x
        for x in loc
    ]
    name = func._schema.name.split("::")[-1]
    for cand in (
        getattr(torch._C._VariableFunctions, name, None),
        getattr(torch._C.TensorBase, name, None),
    ):
        if cand is None:
            continue
        rec = _Record()
        try:
            with rec:
                cand(*margs, **kwargs)
        except Exception:  # no meta kernel, or arguments it does not take
            continue
        if len(rec.calls) == 1:
            f, a, k = rec.calls[0]
            if f is func and _same(list(a), margs) and _same(k, kwargs):
                return cand
    return func._op


_special: dict = {}  # func._op -> its handler off the propagation path, or None


def _special_handler(func):
    random_op = _hooks.random.get(func)
    if random_op is not None:
        return random_op
    if func in _SPEC_ALIASING:
        return _alias_of_self
    if func in _INPLACE_VIEWS:
        return _inplace_view
    return None


def _dispatch(func, args, kwargs, fast_key):
    """The general path: random ops, propagation (cached), redistribution."""
    op = func._op  # hashes in C; an OpOverload hashes in Python
    special = _special.get(op, False)
    if special is False:
        special = _special[op] = _special_handler(func)
    if special is not None:
        if special is _alias_of_self:
            out = _alias_of_self(func, args, kwargs)
            if fast_key is not None:
                _remember(fast_key, func, args, kwargs, None, out)
            return out
        return special(func, args, kwargs)
    key_args, key_kwargs, specs, operands = _flatten(args, kwargs)
    try:
        key = (op, _cache_sig(key_args), _cache_sig(key_kwargs))
        entry = _cache.get(key)
    except TypeError:  # an unhashable argument: no caching for this call
        entry, key = None, None
    if entry is None:
        entry = _propagate(func, args, kwargs, key_args, key_kwargs, specs, operands)
        if key is not None:
            if len(_cache) >= _CACHE_LIMIT:
                _cache.clear()
            _cache[key] = entry
    result = _run(func, args, kwargs, entry, operands)
    if (
        type(result) is DTensor
        and args
        and type(args[0]) is DTensor
        and result is not args[0]
        and result._spec == args[0]._spec
    ):
        result._spec = args[0]._spec  # same-layout views keep the spec object
    if fast_key is not None:
        _remember(fast_key, func, args, kwargs, entry, result)
    return result


def _cache_sig(x):
    """An argument (in key form) as the propagation cache keys it: typed (2,
    2.0 and True hash alike), floats by type alone (see ``_SCALAR_TYPES``)."""
    t = type(x)
    if t is tuple:
        return tuple(map(_cache_sig, x))
    if t is int or t is DTensorSpec or x is None:
        return x
    if t in _SCALAR_TYPES:
        return t
    return (t, x)


def _mesh_of(func, specs):
    mesh = None
    for s in specs:
        if s is None:
            continue
        if mesh is None:
            mesh = s.mesh
        elif s.mesh != mesh:
            raise MeshError(
                f"{func}: operands live on different meshes ({mesh!r} and "
                f"{s.mesh!r}); redistribute or re-create one of them on the other's mesh"
            )
    return mesh


def _propagate(func, args, kwargs, key_args, key_kwargs, specs, operands):
    for a in (*key_args, *(v for _, v in key_kwargs)):
        bad = a if isinstance(a, _Plain) else next(
            (x for x in a if isinstance(x, _Plain)), None
        ) if isinstance(a, tuple) else None
        if bad is not None:
            raise ShardingError(
                f"{func}: got a plain torch.Tensor of shape {tuple(bad.t.shape)} mixed "
                "with DTensors. Convert it with distribute_tensor(t, mesh, placements) "
                "or DTensor.from_local, or wrap the call in "
                "dtensor.implicit_replication() to treat it as replicated."
            )
    if torch.Tag.inplace_view in func.tags or func in _RESIZING:
        raise UnsupportedOpError(
            f"{func}: changes a DTensor's shape or strides in place, which a "
            "DTensor cannot do; use the out-of-place op (e.g. x = x.t())"
        )
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise UnsupportedOpError(
            f"{func}: random ops on DTensors land with dtensor.random; this one has "
            "no sharding-invariant implementation yet. Run it on a plain tensor "
            "(x.full_tensor()) and distribute the result."
        )
    mesh = _mesh_of(func, specs)
    # Plain operands (0-d or allowed by implicit_replication) are replicated.
    full_specs = tuple(
        s
        if s is not None
        else DTensorSpec(
            mesh,
            (Replicate(),) * mesh.ndim,
            TensorMeta(o.shape, o.stride(), o.dtype),
        )
        for s, o in zip(specs, operands, strict=True)
    )
    call = OpCall(func, full_specs, key_args, dict(key_kwargs))
    rule = _rule_for(func)
    sharding = None
    if rule is not None:
        sharding = rule(call)
    if sharding is None:
        return _propagate_fallback(func, mesh, full_specs, args, kwargs, operands)
    targets = tuple(
        None if want is None or tuple(want) == s.placements else s.with_placements(want)
        for s, want in zip(full_specs, sharding.inputs, strict=True)
    )
    written = _written(func, args, kwargs, operands, targets)
    if not sharding.outputs:
        return _Entry(targets, (), False, sharding.scalar_reduce, sharding.local, written)
    return _finish(
        func, mesh, sharding, targets, written, args, kwargs, full_specs, operands,
        (key_args, key_kwargs),
    )


def _propagate_fallback(func, mesh, full_specs, args, kwargs, operands):
    if func not in _logged_fallback:
        _logged_fallback.add(func)
        log.debug("dtensor: no sharding rule for %s; replicating its inputs", func)
    replicate = (Replicate(),) * mesh.ndim
    targets = tuple(
        None if s.placements == replicate else s.with_placements(replicate)
        for s in full_specs
    )
    written = _written(func, args, kwargs, operands, targets)
    return _Entry(targets, (), True, None, None, written)


def _finish(
    func, mesh, sharding, targets, written, args, kwargs, full_specs, operands, keys
):
    metas = None
    if sharding.shapes is not None:
        metas = _shape_metas(
            func, sharding.shapes, args, kwargs, full_specs, operands, *keys
        )
    if metas is None:
        try:
            metas = _infer_meta(func, args, kwargs, full_specs, operands)
        except Exception:  # e.g. an op that needs CPU index data
            # No meta kernel: replicate, and let the local op raise real errors.
            return _propagate_fallback(func, mesh, full_specs, args, kwargs, operands)
    outputs = sharding.outputs
    if len(metas) != len(outputs) and len(outputs) == 1 and _returns_list(func):
        outputs = outputs * len(metas)
    if len(metas) != len(outputs):
        raise AssertionError(
            f"{func}: rule gave {len(outputs)} output placements for "
            f"{len(metas)} tensor outputs"
        )
    out_specs = tuple(
        DTensorSpec(mesh, tuple(p), m)
        for p, m in zip(outputs, metas, strict=True)
        if m is not None
    )
    return _Entry(targets, out_specs, False, sharding.scalar_reduce, sharding.local, written)


def _returns_list(func) -> bool:
    rets = func._schema.returns
    return len(rets) == 1 and isinstance(rets[0].type, torch.ListType)


def _written(func, args, kwargs, operands, targets) -> tuple[int, ...]:
    """Indices of DTensor operands the op writes whose layout the op changes."""
    if not any(t is not None for t in targets):
        return ()
    out = []
    schema_args = func._schema.arguments
    for i, a in enumerate(schema_args):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if a.kwarg_only or i >= len(args):
            v = kwargs.get(a.name)
        else:
            v = args[i]
        vals = v if isinstance(v, (list, tuple)) else (v,)
        for x in vals:
            if isinstance(x, DTensor):
                for j, o in enumerate(operands):
                    if o is x and targets[j] is not None:
                        out.append(j)
    return tuple(out)


_probes: dict = {}
_functional: dict = {}


def _is_functional(func) -> bool:
    """No argument or result of ``func`` aliases or writes another."""
    ok = _functional.get(func)
    if ok is None:
        schema = func._schema
        ok = _functional[func] = not any(
            a.alias_info is not None for a in (*schema.arguments, *schema.returns)
        )
    return ok


def _shape_metas(func, shapes, args, kwargs, specs, operands, key_args, key_kwargs):
    """Output metadata from a rule's global ``shapes``, or None.

    Applies when the op is functional and every operand is contiguous and
    non-empty: then outputs are contiguous (checked once on the probe). Dtypes
    come from the op run once on small meta tensors (every dim 2), cached per
    signature: (op, operand dtypes and ranks, other arguments with types).
    """
    if not _is_functional(func):
        return None
    for s in specs:
        if 0 in s.shape or s.stride != contiguous_stride(s.shape):
            return None
    for shape in shapes:
        if 0 in shape:
            return None
    try:
        pkey = (
            func,
            tuple(map(_probe_sig, key_args)),
            tuple((k, _probe_sig(v)) for k, v in key_kwargs),
        )
        dtypes = _probes.get(pkey, False)
    except TypeError:  # unhashable values
        return None
    if dtypes is False:
        ids = {id(o): s for o, s in zip(operands, specs, strict=True)}
        dtypes = _probe(func, args, kwargs, ids, shapes)
        if len(_probes) >= _CACHE_LIMIT:
            _probes.clear()
        _probes[pkey] = dtypes
    if dtypes is None:
        return None
    return tuple(
        TensorMeta(shape, contiguous_stride(shape), dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )


def _probe_sig(x):
    """What of an argument (in key form) can decide a result dtype."""
    t = type(x)
    if t is DTensorSpec:
        return (x.dtype, x.ndim)
    if t is int or x is None:
        return x
    if t is tuple:
        return tuple(map(_probe_sig, x))
    if t is _PlainKey:
        return (x.dtype, len(x.shape))
    if t in _SCALAR_TYPES:  # type promotion looks at a scalar's type, not its value
        return t
    return (t, x)


def _probe(func, args, kwargs, ids, shapes):
    """Result dtypes of ``func`` on meta tensors whose dims are all 2, if its
    results are contiguous and as many (and of the same ranks) as ``shapes``."""

    def small(x):
        s = ids[id(x)]
        return torch.empty((2,) * s.ndim, dtype=s.dtype, device="meta")

    margs, mkwargs = _map_tensors(small, args, kwargs)
    if mkwargs.get("device") is not None:
        mkwargs["device"] = "meta"
    try:
        leaves = _tensor_leaves(func(*margs, **mkwargs))
    except Exception:  # the full meta run will tell
        return None
    if len(leaves) != len(shapes) or any(
        t.ndim != len(shape) or not t.is_contiguous()
        for t, shape in zip(leaves, shapes, strict=True)
    ):
        return None
    return tuple(t.dtype for t in leaves)


def _infer_meta(func, args, kwargs, specs, operands) -> tuple[TensorMeta, ...]:
    """Global output metadata from the op run on meta tensors of global shape."""
    it = iter(specs)
    ops = {id(o) for o in operands}

    def to_meta(x):
        if isinstance(x, torch.Tensor) and id(x) in ops:
            s = next(it)
            return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
        return x

    margs, mkwargs = _map_tensors(to_meta, args, kwargs)
    if mkwargs.get("device") is not None:
        mkwargs["device"] = "meta"
    out = func(*margs, **mkwargs)
    if isinstance(out, tuple) and any(x is None for x in out):
        # Optional results (masked backward outputs) keep their slot as None.
        return tuple(
            None if x is None else TensorMeta(x.shape, x.stride(), x.dtype) for x in out
        )
    metas = []
    for t in _tensor_leaves(out):
        metas.append(TensorMeta(t.shape, t.stride(), t.dtype))
    return tuple(metas)


def _map_tensors(fn, args, kwargs):
    def m(x):
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x):
            return type(x)(fn(y) if isinstance(y, torch.Tensor) else y for y in x)
        return x

    return tuple(m(a) for a in args), {k: m(v) for k, v in kwargs.items()}


def _tensor_leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _tensor_leaves(x)]
    return []


def _run(func, args, kwargs, entry: _Entry, operands):
    mesh = None
    for o in operands:
        if isinstance(o, DTensor):
            mesh = o._spec.mesh
            break
    member = mesh.get_coordinate() is not None
    if not member:
        return _outsider_result(func, args, kwargs, entry, mesh)
    # Local operands in operand order, redistributed where the rule asks.
    # NOTE: by position, not identity: ``mm(x, x)`` may need x in two layouts.
    locals_ = []
    for o, target in zip(operands, entry.targets, strict=True):
        if isinstance(o, DTensor):
            local = o._local_tensor
            if target is not None:
                local = redistribute_local(local, o._spec, target)
            locals_.append(local)
        elif target is not None:  # a plain (replicated) operand the rule shards
            src = target.with_placements((Replicate(),) * mesh.ndim)
            locals_.append(redistribute_local(o, src, target))
        else:
            locals_.append(o)

    largs, lkwargs = _substitute(args, kwargs, locals_)
    if entry.local is not None:
        out = entry.local(func, mesh.get_coordinate(), entry.out_specs, largs, lkwargs)
    else:
        out = func(*largs, **lkwargs)

    written = {}
    for j in entry.write_back:
        o = operands[j]
        local = locals_[j]
        written[id(local)] = o
        block = redistribute_local(local, entry.targets[j], o._spec)
        if block is not o._local_tensor:
            o._local_tensor.copy_(block)

    if entry.fallback:
        if written:
            return _wrap_written(out, written, mesh)
        return _wrap_replicated(out, mesh, func, args)
    if not entry.out_specs:
        return _reduce_scalar(out, entry.scalar_reduce, mesh)
    specs = iter(entry.out_specs)
    return _rewrap(out, specs, func, args, written)


def _substitute(args, kwargs, locals_):
    """``args``/``kwargs`` with their tensors replaced by ``locals_``, in order."""
    it = iter(locals_)
    largs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = next(it)
        elif type(a) in (list, tuple) and any(isinstance(y, torch.Tensor) for y in a):
            a = type(a)(next(it) if isinstance(y, torch.Tensor) else y for y in a)
        largs.append(a)
    if not kwargs:
        return tuple(largs), {}
    _, lkwargs = _map_tensors(lambda x: next(it), (), kwargs)
    return tuple(largs), lkwargs


def _rewrap(out, specs, func, args, written):
    if isinstance(out, torch.Tensor):
        spec = next(specs)
        if written and id(out) in written:
            return written[id(out)]
        # In-place ops return their (DTensor) self: hand it back, not a copy.
        if _is_inplace(func) and isinstance(args[0], DTensor):
            return args[0]
        return _wrap(out, spec)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(x, specs, func, args, written) for x in out)
    return out


def _wrap_written(out, written, mesh):
    """Fallback result of an op that wrote redistributed operands: hand those back."""
    if isinstance(out, torch.Tensor):
        if id(out) in written:
            return written[id(out)]
        replicate = (Replicate(),) * mesh.ndim
        meta = TensorMeta(out.shape, out.stride(), out.dtype)
        return DTensor(out, DTensorSpec(mesh, replicate, meta))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_written(x, written, mesh) for x in out)
    return out


def _is_inplace(func) -> bool:
    inplace = _inplace.get(func)
    if inplace is None:
        schema = func._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        inplace = _inplace[func] = first is not None and first.is_write
    return inplace


_inplace: dict = {}


def _wrap_replicated(out, mesh, func, args):
    replicate = (Replicate(),) * mesh.ndim
    if isinstance(out, torch.Tensor):
        if _is_inplace(func) and isinstance(args[0], DTensor):
            return _write_back(args[0], out)
        meta = TensorMeta(out.shape, out.stride(), out.dtype)
        return DTensor(out, DTensorSpec(mesh, replicate, meta))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(x, mesh, func, args) for x in out)
    return out


def _write_back(self: DTensor, full: torch.Tensor) -> DTensor:
    """An in-place op computed on the replicated value: store it in self's layout."""
    spec = self._spec
    replicated = spec.with_placements((Replicate(),) * spec.mesh.ndim)
    block = redistribute_local(full, replicated, spec) if not spec.is_replicated() else full
    if block is not self._local_tensor:
        self._local_tensor.copy_(block)
    return self


def _reduce_scalar(out, how, mesh):
    if how == "all":
        flag = torch.tensor([0 if bool(out) else 1], dtype=torch.int64)
        return not bool(_mesh_max(flag, mesh).item())
    return out


def _outsider_result(func, args, kwargs, entry: _Entry, mesh):
    """Empty outputs of the right dtype on ranks outside the mesh; no collectives."""
    if entry.fallback or not entry.out_specs:
        # Output metadata from the op on meta tensors of the global shapes.
        specs = []

        def to_meta(x):
            if isinstance(x, DTensor):
                s = x._spec
                return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
            return x.to("meta") if isinstance(x, torch.Tensor) else x

        margs, mkwargs = _map_tensors(to_meta, args, kwargs)
        try:
            out = func(*margs, **mkwargs)
        except Exception:
            out = None
        leaves = _tensor_leaves(out)
        if not leaves:
            if out is None or not isinstance(out, torch.Tensor):
                return None
        replicate = (Replicate(),) * mesh.ndim
        specs = [
            DTensorSpec(mesh, replicate, TensorMeta(t.shape, t.stride(), t.dtype))
            for t in leaves
        ]
        out_specs = iter(specs)
        template = out
    else:
        out_specs = iter(entry.out_specs)
        template = None

    device = _device_of(mesh)

    def empty(spec):
        shape, _ = local_block(spec.shape, spec.mesh.shape, spec.placements, None)
        return DTensor(torch.empty(shape, dtype=spec.dtype, device=device), spec)

    if template is None:
        if len(entry.out_specs) == 1:
            return empty(entry.out_specs[0])
        return tuple(empty(s) for s in entry.out_specs)

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return empty(next(out_specs))
        if isinstance(x, (list, tuple)):
            return type(x)(rebuild(y) for y in x)
        return None

    return rebuild(template)


def describe(func, specs) -> str:
    """Human-readable op schema for error messages."""
    return f"{func}({', '.join(str(s) for s in specs)})"


_ = format_placements  # re-exported name used by rule modules' messages
