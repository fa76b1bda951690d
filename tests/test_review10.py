"""Review of f976810 (held-tensor express backward, run loop of Tracker.plain_loop): failing
tests for the defects found (each passes on the parent 2da26ec)."""

from __future__ import annotations

import numpy as np
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
from lowering import solvers as S

F64 = torch.float64


def test_unrolled_call_keeps_no_image_in_last_stats() -> None:
    mod = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0))).torch_module(
        weight_control=None, dtype=F64, backward="unroll")
    mod(torch.randn(8, 64, dtype=F64, requires_grad=True))
    assert mod.last_stats.__dict__.get("image") is None


def test_run_loop_records_the_exact_residual_of_an_infinite_plain_one() -> None:
    """||fz|| = 0 at a nonzero iterate: the plain residual is +inf; the parent recorded the exact
    (scaled) residual there, as record() does, the run appends inf."""
    t = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], dtype=F64)
    calls = [0]

    def f(z: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.zeros_like(z) if calls[0] == 3 else 0.5 * z + 0.5 * t

    _, st = S.solve(f, torch.zeros(2, 3, dtype=F64), solver="plain", tol=1e-8, max_iter=80)
    res = st.residuals if isinstance(st.residuals, torch.Tensor) else torch.cat(st.residuals, 1)
    assert bool(torch.isfinite(res).all()), res[:, :5]


def test_output_keeps_its_graph_when_only_an_unreached_parameter_needs_grad() -> None:
    w = qp_weight(64, norm=0.9, seed=0)
    m, d = w.shape
    z, q = State("z", d), Input("q", d)
    obj = Objective([Potential("relu", z), SqNorm(z), -Linear(q, z),
                     -SqNorm(Weight("W", (m, d), w) @ z),
                     SqNorm(Weight("V", (d, d), np.eye(d)) @ q)])
    mod = lowering.lower(obj).torch_module(weight_control=None, dtype=F64)
    mod.weights.W.requires_grad_(False)
    out = mod(torch.randn(8, d, dtype=F64))
    assert out.requires_grad  # (the parent: a grad_fn; loss.backward() gives V.grad None)
    out.sum().backward()
