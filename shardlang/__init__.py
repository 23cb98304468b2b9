"""shardlang: a small language for how tensors lie on device meshes.

This package is the language core: meshes, layouts, spec files, their text, and conversions
to other frameworks' layout descriptions. It knows nothing of planning or communication.
"""

from shardlang import interop  # torch is imported only when a DTensor conversion is called
from shardlang.errors import (
    InteropError,
    LayoutError,
    ParseError,
    ShardlangError,
    SourcePosition,
    SpecError,
)
from shardlang.generate import STRATEGIES, spec_for
from shardlang.layout import REDUCE_OPS, Layout, chunk_bounds, format_layout, padded_length
from shardlang.mesh import Mesh
from shardlang.parser import load_spec, parse_layout, parse_mesh, parse_spec
from shardlang.spec import CostHints, Layouts, MeshDecl, Rule, Spec, TensorSpec
from shardlang.writer import format_spec

__all__ = [
    "REDUCE_OPS",
    "STRATEGIES",
    "CostHints",
    "InteropError",
    "Layout",
    "LayoutError",
    "Layouts",
    "Mesh",
    "MeshDecl",
    "ParseError",
    "Rule",
    "ShardlangError",
    "SourcePosition",
    "Spec",
    "SpecError",
    "TensorSpec",
    "chunk_bounds",
    "format_layout",
    "format_spec",
    "interop",
    "load_spec",
    "padded_length",
    "parse_layout",
    "parse_mesh",
    "parse_spec",
    "spec_for",
]
