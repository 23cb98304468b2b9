"""``shardlang init``: write a spec for a model, from a Python factory or a list of shapes.

    shardlang init --model mypkg.models:gpt2 --mesh 'world = [dp=8]' --strategy zero1 -o gpt2.shard
    shardlang init --shapes shapes.json --mesh 'world = [dp=4]' --strategy zero3

``--model package.module:factory`` is imported (the current folder first on the path) and
called with no arguments; it must return a ``torch.nn.Module``, whose ``named_parameters()``
are the tensors. ``--shapes FILE`` is JSON: a list of ``[name, shape]`` or ``[name, shape,
dtype]`` entries (or objects with those keys). Layouts per strategy: ``shardlang.generate``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from cli.inputs import UsageError
from cli.tables import format_bytes
from shardlang import STRATEGIES, Spec, TensorSpec, format_spec, spec_for
from shardlang.dtypes import itemsize
from shardlang.errors import SpecError
from shardlang.generate import as_rules

# States are kept in f32, or f64 for f64 parameters (planner.spec_plan: the optimizers' choice).
_STATE_ITEMSIZE = {"f64": 8}


def add_init_parser(sub: Any) -> None:
    p = sub.add_parser(
        "init",
        help="write a spec for a model (a factory or a list of shapes) and a strategy",
        description="Write a spec file for a model: every parameter's layouts under a strategy "
        "(ddp, zero1, zero2, zero3) on a mesh whose axes are all data parallel.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="MODULE:FACTORY", help="a function returning an nn.Module, called bare")
    source.add_argument("--shapes", metavar="FILE", help="JSON list of [name, shape] or [name, shape, dtype]")
    p.add_argument("--mesh", required=True, metavar="DECL", help="the mesh, as in a spec file: 'world = [dp=8]'")
    p.add_argument("--strategy", choices=STRATEGIES, default="zero1", help="default zero1")
    p.add_argument(
        "--rules",
        action="store_true",
        help="write rank-free rules (one per set of layouts, '*' last) instead of tensors with shapes",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="where to write (default: standard output)")


def named_tensors(args: argparse.Namespace) -> list[Any]:
    """``(name, tensor)`` pairs of the factory's module, or the entries of the shapes file."""
    if args.model is not None:
        return list(_module(args.model).named_parameters())
    return _shapes(Path(args.shapes))


def _module(target: str) -> Any:
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise UsageError(f"--model '{target}': write package.module:factory")
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure of the user's code is one message
        raise SpecError(f"--model {target}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    finally:
        sys.path.pop(0)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SpecError(f"--model {target}: {module_name} has no function {factory_name}")
    try:
        model = factory()
    except Exception as e:  # the user's factory failed: one message, no traceback
        raise SpecError(f"--model {target}: {factory_name}() raised {type(e).__name__}: {e}") from None
    import torch  # only here: the rest of the command needs no torch

    if not isinstance(model, torch.nn.Module):
        raise SpecError(f"--model {target}: {factory_name}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _shapes(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, list):
        raise SpecError(f"{path}: expected a list of [name, shape] entries")
    out = []
    for k, item in enumerate(data):
        if isinstance(item, dict) and "name" in item and "shape" in item:
            item = [item["name"], item["shape"], *([item["dtype"]] if "dtype" in item else [])]
        if not (isinstance(item, list) and len(item) in (2, 3) and isinstance(item[1], list)):
            raise SpecError(f"{path}: entry {k} is not [name, shape] or [name, shape, dtype]: {item!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in item[1]):
            raise SpecError(f"{path}: entry {k} ('{item[0]}'): a shape is a list of integers")
        out.append(item)
    return out


def tensor_bytes(tensor: TensorSpec) -> tuple[int, int, int]:
    """Per rank: the parameter's, the gradient's and one optimizer state's bytes (padded pieces)."""
    size = itemsize(tensor.dtype)
    state = _STATE_ITEMSIZE.get(tensor.dtype, 4)

    def local(layout: Any, per: int) -> int:
        return math.prod(layout.local_shape(tensor.shape)) * per

    return local(tensor.param, size), local(tensor.grad, size), local(tensor.state(), state)


def bytes_comment(tensor: TensorSpec, count: int) -> str:
    param, grad, state = tensor_bytes(tensor)
    each = " each" if count > 1 else ""
    return (
        f"per rank{each}: param {format_bytes(param)}, grad {format_bytes(grad)}, "
        f"{format_bytes(state)} per optimizer state"
    )


def init_text(spec: Spec, source: str, strategy: str, rules: bool = False) -> str:
    header = [f"Written by `shardlang init {source} --strategy {strategy}`.", "Every mesh axis is data parallel."]
    if rules:
        header.append("Rank-free rules: a layout's dims past those it names are replicated (docs/language.md).")
        return format_spec(as_rules(spec), header=header)
    return format_spec(spec, comment=bytes_comment, header=header)


def cmd_init(args: argparse.Namespace) -> int:
    spec = spec_for(named_tensors(args), args.mesh, args.strategy)
    source = f"--model {args.model}" if args.model is not None else f"--shapes {args.shapes}"
    text = init_text(spec, f"{source} --mesh '{args.mesh}'" + " --rules" * args.rules, args.strategy, args.rules)
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as e:
        raise SpecError(f"{args.output}: cannot write: {e.strerror}") from None
    n = len(spec.tensors)
    print(f"wrote {args.output}: {n} tensor{'s' * (n != 1)}, {args.strategy}", file=sys.stderr)
    return 0
