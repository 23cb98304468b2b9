"""``prefetch_params`` is safe to read, on 2 gloo ranks: ``model.state_dict()`` (or a unit's)
read right after ``step()``, before any forward and without ``optimizer.wait_params()``, holds
the step's parameters, equal bit for bit to ``torch.optim.AdamW`` on the full gradients (the
gathers' results land late: ``tests.late_results``)."""

from __future__ import annotations

import torch

from runtime.testing import run_ranks
from tests.late_results import LateResults
from tests.optim_support import ADAMW, CONFIGS, SHAPES, _optimizer, _reference_run, _spec, initial_params
from tests.test_overlap_dist import BUCKET_BYTES, Pieces
from tests.test_overlap_grads_dist import _pieces

STEPS = 3
SEED = 43


def _read_after_each_step(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    spec = _spec("mesh[dp=2]", CONFIGS["zero_rows"][1])
    model = Pieces(initial_params(torch.float32, SEED))
    named = [(n, model.parts[n].weight) for n in SHAPES]
    optimizer = _optimizer("adamw", named, spec, overlap=True, bucket_bytes=BUCKET_BYTES, timeout=20.0)
    optimizer.prefetch_params(*model.parts.values())
    read = []
    results = LateResults()
    with results.installed(), results.delayed():
        for step in range(STEPS):
            optimizer.zero_grad()
            model(_pieces(spec, rank, step, SEED)).backward()
            optimizer.step()
            if step % 2 == 0:  # the whole model's state_dict
                state = {k.removeprefix("parts.").removesuffix(".weight"): v for k, v in model.state_dict().items()}
            else:  # each unit's own
                state = {n: model.parts[n].state_dict()["weight"] for n in SHAPES}
            read.append({n: t.detach().clone() for n, t in state.items()})
    return read


def test_state_dict_right_after_a_prefetching_step_holds_the_steps_parameters() -> None:
    for rank, read in enumerate(run_ranks(_read_after_each_step, 2, timeout=180)):
        for step, state in enumerate(read):
            want = _reference_run("adamw", torch.float32, SEED, step + 1, ADAMW)
            for name in SHAPES:
                assert torch.equal(state[name], want[name]), f"rank {rank} step {step + 1} '{name}' is stale"
