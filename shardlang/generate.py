"""Specs for whole models from their tensors' names and shapes, for the usual strategies.

Every mesh axis is taken as data parallel, and sharding splits one dim over all of them, outer
axis first (docs/language.md, "Generating specs"):

========  ============  ====================  ==================
strategy  param         grad                  states
========  ============  ====================  ==================
ddp       R             R | P(axes):avg       R
zero1     R             R                     S(axes) on dim d
zero2     R             R | P(axes):avg       S(axes) on dim d
zero3     S(axes) on d  S(axes) on dim d      S(axes) on dim d
========  ============  ====================  ==================

A gradient pending a mean (``| P(axes):avg``) is reduced by the optimizer step: DDP's
all-reduce, or ZeRO-2's reduce-scatter straight into the state shards. ZeRO-1's gradient
arrives already all-reduced (DDP's backward hooks), and the step only slices its shard.
ZeRO-3's parameter and gradient are the rank's shard (FSDP's), gathered for compute by the
training loop. ``d`` is the first dim whose length the mesh size divides, else the longest
dim; a 0-d tensor is never split.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from shardlang.dtypes import ITEMSIZE
from shardlang.errors import SpecError
from shardlang.layout import Layout
from shardlang.mesh import Mesh
from shardlang.parser import parse_spec
from shardlang.spec import STATE_DEFAULT, CostHints, Layouts, MeshDecl, Rule, Spec, TensorSpec
from shardlang.writer import fold_names, format_spec

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")
# torch dtypes by their names after ``torch.`` (so that this module needs no torch).
_TORCH_DTYPES = {
    "float64": "f64",
    "double": "f64",
    "float32": "f32",
    "float": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "half": "f16",
    "int64": "i64",
    "long": "i64",
    "int32": "i32",
    "int": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
}


def mesh_decl(mesh: Mesh | MeshDecl | str) -> MeshDecl:
    """A mesh declaration from a :class:`Mesh` (named, or named ``world``), a
    :class:`MeshDecl`, or the text after ``mesh`` in a spec file: ``world = [dp=8]``."""
    if isinstance(mesh, MeshDecl):
        return mesh
    if isinstance(mesh, Mesh):
        return MeshDecl(mesh=mesh if mesh.name is not None else attrs.evolve(mesh, name="world"), hints=CostHints())
    spec = parse_spec(f"mesh {mesh}", filename="--mesh")
    if len(spec.meshes) != 1 or spec.tensors or spec.rules:
        raise SpecError(f"'{mesh}' is not one mesh declaration such as 'world = [dp=8]'")
    return spec.meshes[0]


def dtype_of(value: Any) -> str:
    """The language's name of a dtype: ``f32`` as it is, or a torch dtype (``torch.bfloat16``)."""
    text = str(value).removeprefix("torch.")
    if text in ITEMSIZE:
        return text
    if text in _TORCH_DTYPES:
        return _TORCH_DTYPES[text]
    raise SpecError(f"dtype {value} has no name in the language (names: {', '.join(ITEMSIZE)})")


def split_dim(shape: Sequence[int], parts: int) -> int | None:
    """The dim a strategy shards: the first that ``parts`` divides, else the longest."""
    if not shape:
        return None
    even = [d for d, length in enumerate(shape) if length % parts == 0 and length > 0]
    return even[0] if even else max(range(len(shape)), key=lambda d: (shape[d], -d))


def strategy_layouts(strategy: str, shape: Sequence[int], mesh: Mesh) -> Layouts:
    """The layouts ``strategy`` gives a tensor of ``shape`` (table in the module doc)."""
    if strategy not in STRATEGIES:
        raise SpecError(f"unknown strategy '{strategy}' (expected one of {', '.join(STRATEGIES)})")
    axes = tuple(range(mesh.ndim))
    replicated = Layout(dims=((),) * len(shape), mesh=mesh)
    pending = Layout(dims=replicated.dims, mesh=mesh, partial=tuple((a, "avg") for a in axes))
    d = split_dim(shape, mesh.size)
    split = replicated
    if d is not None:
        split = Layout(dims=tuple(axes if i == d else () for i in range(len(shape))), mesh=mesh)
    param, grad, state = {
        "ddp": (replicated, pending, replicated),
        "zero1": (replicated, replicated, split),
        "zero2": (replicated, pending, split),
        "zero3": (split, split, split),
    }[strategy]
    return Layouts(param=param, grad=grad, states=((STATE_DEFAULT, state),))


def named_entries(named: Iterable[Any], dtype: str = "f32") -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of ``(name, tensor)`` pairs or ``(name, shape[, dtype])``
    entries (``dtype`` where an entry gives none), names and shapes checked."""
    out = []
    for item in named:
        name, value, *rest = item
        if not isinstance(name, str) or not _NAME.match(name):
            raise SpecError(f"tensor name {name!r} may hold only letters, digits, '_', '.' and '-'")
        if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor or a parameter
            shape, kind = tuple(int(n) for n in value.shape), dtype_of(value.dtype)
        else:
            try:
                shape = tuple(int(n) for n in value)
            except (TypeError, ValueError):
                raise SpecError(f"tensor '{name}': {value!r} is neither a tensor nor a shape") from None
            kind = dtype_of(rest[0]) if rest else dtype
        if any(n < 0 for n in shape):
            raise SpecError(f"tensor '{name}': shape {list(shape)} has a negative length")
        out.append((name, shape, kind))
    return out


def spec_for(
    named: Iterable[Any],
    mesh: Mesh | MeshDecl | str,
    strategy: str = "zero1",
    *,
    dtype: str = "f32",
) -> Spec:
    """The spec of a model for ``strategy`` on ``mesh``, its tensors in the order of its text
    (:func:`shardlang.writer.format_spec` writes it compactly: tensors of one shape and layouts
    declared together, with brace names).

    ``named`` holds ``(name, tensor)`` pairs (``model.named_parameters()``) or ``(name, shape)``
    or ``(name, shape, dtype)`` entries (``dtype`` is the default for these).
    """
    decl = mesh_decl(mesh)
    entries = named_entries(named, dtype)
    seen: set[str] = set()
    tensors = []
    for name, shape, kind in entries:
        if name in seen:
            raise SpecError(f"tensor '{name}' is given twice")
        seen.add(name)
        layouts = strategy_layouts(strategy, shape, decl.mesh)
        tensors.append(TensorSpec(name=name, dtype=kind, shape=shape, layouts=layouts))
    if not tensors:
        raise SpecError("the model has no tensors")
    spec = Spec(meshes=(decl,), tensors=tuple(tensors), rules=())
    # Through the text: the tensors come in the order its brace names expand.
    return parse_spec(format_spec(spec))


def _trimmed(layouts: Layouts) -> Layouts:
    """The layouts naming only the dims up to the last one any of them splits (at least one
    dim; a 0-d tensor's stay ``()``): the rank-free form a rule can give tensors of any rank."""
    named = [layouts.param, layouts.grad, *(v for _, v in layouts.states)]
    ndim = named[0].ndim
    keep = min(ndim, max([1] + [d + 1 for lay in named for d, axes in enumerate(lay.dims) if axes]))

    def cut(layout: Layout) -> Layout:
        return Layout(dims=layout.dims[:keep], mesh=layout.mesh, partial=layout.partial)

    states = tuple((k, cut(v)) for k, v in layouts.states)
    return Layouts(param=cut(layouts.param), grad=cut(layouts.grad), states=states)


def as_rules(spec: Spec) -> Spec:
    """The declared tensors of ``spec`` as rank-free rules (docs/language.md, "Rules"): one rule
    per set of layouts, naming its tensors with braces, and the most common set as the last
    rule, ``"*"``. ``resolve`` of every tensor gives its declared layouts back."""
    groups: dict[Layouts, list[str]] = {}
    for t in spec.tensors:
        groups.setdefault(_trimmed(t.layouts), []).append(t.name)
    common = max(groups, key=lambda k: len(groups[k]))
    rules = [Rule(pattern=p, layouts=k) for k, names in groups.items() if k != common for p in fold_names(names)]
    rules.append(Rule(pattern="*", layouts=common))
    return attrs.evolve(spec, tensors=(), rules=tuple(rules))
