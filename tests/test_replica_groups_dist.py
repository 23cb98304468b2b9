"""What an optimizer checks when it is given parameters, at construction and in
``add_param_group``, on 2 gloo ranks (texts golden: tests/golden/construction_errors.txt):

- an added group whose parameters differ across the ranks that declare them replicated is
  ``ReplicaMismatchError`` on every rank, as at construction, and nothing is added; equal
  ones then train with the first group, as ``torch.optim.AdamW`` on the averaged gradient;
- an added parameter whose shape is not its spec entry's is refused, nothing added;
- a spec whose mesh holds more ranks than the job (``mesh[dp=4]`` on 2 ranks) is an
  ``OptimizerError`` at construction on every rank, naming the mesh and the world size, not a
  process-group error at the first collective;
- ranks given different specs or models, with ``verify=False`` and ``verify_replicas=False``
  (rank 1's parameter in f64; rank 1's states in another layout): an ``OptimizerError`` at
  construction on every rank naming the tensor, what differs and the ranks, not a gloo abort
  (f64) or a timeout (layouts) at the first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import attempt, run_ranks
from tests.golden_blocks import golden_blocks

GOLDEN = Path(__file__).parent / "golden" / "construction_errors.txt"
SHAPES = {"w": (4, 3), "b": (3,)}
LR = {"w": 0.1, "b": 0.05}


def _spec(mesh: str = "mesh[dp=2]", state: str = "S(dp)") -> dict:
    from shardlang import parse_layout
    from shardlang.spec import Layouts, TensorSpec

    def layouts(n: int) -> Layouts:
        dims = ",".join(["R"] * n)
        return Layouts(
            param=parse_layout(f"{dims} over {mesh}"),
            grad=parse_layout(f"{dims} | P(dp):avg over {mesh}"),
            states=(("", parse_layout(f"{state}{',R' * (n - 1)} over {mesh}")),),
        )

    return {n: TensorSpec(name=n, dtype="f32", shape=s, layouts=layouts(len(s))) for n, s in SHAPES.items()}


def _param(name: str, rank: int, off_on: int | None = None) -> torch.nn.Parameter:
    generator = torch.Generator().manual_seed(len(name))
    value = torch.randn(SHAPES[name], generator=generator)
    if rank == off_on:
        value[1] += 1e-3  # a forgotten seed on one rank
    return torch.nn.Parameter(value)


def _grad(name: str, rank: int) -> torch.Tensor:
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(100 + 10 * rank + len(name)))


def _run(rank: int, world_size: int) -> dict[str, Any]:
    from runtime.optim import ShardedAdamW

    out: dict[str, Any] = {}
    w = _param("w", rank)
    optimizer = ShardedAdamW([("w", w)], _spec(), lr=LR["w"], timeout=30)
    differing = _param("b", rank, off_on=1)
    out["added group"] = attempt(lambda: optimizer.add_param_group({"params": [("b", differing)], "lr": LR["b"]}))
    out["groups after"] = (len(optimizer.param_groups), len(optimizer._slots))
    wrong = torch.nn.Parameter(torch.zeros(4))
    out["added shape"] = attempt(lambda: optimizer.add_param_group({"params": [("b", wrong)], "lr": LR["b"]}))
    out["groups after shape"] = (len(optimizer.param_groups), len(optimizer._slots))
    b = _param("b", rank)
    optimizer.add_param_group({"params": [("b", b)], "lr": LR["b"]})
    for p, name in ((w, "w"), (b, "b")):
        p.grad = _grad(name, rank)
    optimizer.step()
    out["trained"] = {"w": w.detach().clone(), "b": b.detach().clone()}
    out["larger mesh"] = attempt(lambda: ShardedAdamW([("w", _param("w", rank))], _spec("mesh[dp=4]"), lr=0.1))
    unchecked = {"lr": 0.1, "timeout": 30, "verify": False, "verify_replicas": False}
    w64 = torch.nn.Parameter(_param("w", rank).detach().to(torch.float64 if rank == 1 else torch.float32))
    out["other dtype"] = attempt(lambda: _stepped(ShardedAdamW([("w", w64)], _spec(), **unchecked)))
    spec = _spec(state="R" if rank == 1 else "S(dp)")
    out["other layouts"] = attempt(lambda: _stepped(ShardedAdamW([("w", _param("w", rank))], spec, **unchecked)))
    return out


def _stepped(optimizer: Any) -> None:
    """A step, which ranks given different tensors cannot run together."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_run, 2, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["added group", "added shape", "larger mesh", "other dtype", "other layouts"])
def test_each_is_the_golden_error_on_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    got = [f"rank {rank}: {out[case][0]}: {out[case][1]}" for rank, out in enumerate(ranks)]
    assert got == golden_blocks(GOLDEN)[case], "\n".join(got)


@pytest.mark.slow
def test_a_refused_group_adds_nothing_and_an_equal_one_trains_as_torch(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["groups after"] == (1, 1) and out["groups after shape"] == (1, 1), out
    reference = {n: torch.nn.Parameter(_param(n, 0).detach().clone()) for n in SHAPES}
    torch_adamw = torch.optim.AdamW([{"params": [reference[n]], "lr": LR[n]} for n in SHAPES])
    for n, p in reference.items():
        p.grad = (_grad(n, 0) + _grad(n, 1)) / 2
    torch_adamw.step()
    for rank, out in enumerate(ranks):
        for n, p in reference.items():
            torch.testing.assert_close(out["trained"][n], p.detach(), rtol=0, atol=1e-6, msg=f"rank {rank} {n}")
