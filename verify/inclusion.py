"""``verify.check_inclusion``: verify a splitting layer (an ``Inclusion`` or ``Saddle`` source)
by a tight float64 solve and every inclusion reference that applies (docs/monotone.md §6)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from convex_eq.errors import OptionError
from lowering import DerivedLayer, EquilibriumModule

from .conic import reference_solver_options
from .equilibrium import (
    environment,
    equilibrium,
    operator,
    prepare_inputs,
    relative_residual,
    resolve_target,
    single_thread,
)
from .module_output import Against, judge_module
from .references.inclusion import INCLUSION_REFERENCES, LCP_FLOOR, InclusionContext, handles
from .report import InclusionReport

__all__ = ["InclusionReport", "check_inclusion", "handles"]


def check_inclusion(target: Any, x: Any, *, tol: float = 1e-6,
                    solver_options: Mapping[str, Any] | None = None) -> InclusionReport:
    """Verify a splitting layer (``lower`` of an ``Inclusion`` or ``Saddle``, or its module)
    at inputs ``x``: a tight float64 solve of the layer, then every applicable reference.
    ``tol``: relative state tolerance (the gap's distance bound, the LCP solution, the
    relative duality gap)."""
    t0 = time.perf_counter()
    with single_thread():
        derived, module = resolve_target(target)
        src = derived.source
        if not handles(src):
            raise OptionError(f"check_inclusion verifies inclusion/saddle layers, got a "
                              f"{type(src).__name__} source", term="verify.check_inclusion",
                              hint="use verify.check for objectives")
        env = environment(derived, module)
        inputs = prepare_inputs(derived, x)
        z, eq = equilibrium(derived, inputs, env, tol=1e-13, max_iter=20000)
        with torch.no_grad():
            out = derived.output(z, inputs, env)
        blocks = derived.output_blocks
        outputs, o = {}, 0
        for blk in blocks:
            outputs[blk.name] = out[:, o:o + blk.size].numpy().copy()
            o += blk.size
        with torch.no_grad():
            res = relative_residual(z, operator(derived, inputs, env)(z))
        refs = [r for r in INCLUSION_REFERENCES if r.applies(src)]
        cert = derived.certificate
        opts = reference_solver_options(solver_options)
        report = InclusionReport(f"{derived.derivation.rules()[-1]} layer of {src}",
                                 derived.claim.statement,
                                 cert.long_text() if cert is not None else "",
                                 [r.kind for r in refs], tol, z_layer=out.numpy().copy(),
                                 equilibrium=eq, residuals=[float(r) for r in res],
                                 claim_kind=str(derived.claim.kind),
                                 certified=cert is None or cert.holds,
                                 block_names=[b.name for b in blocks],
                                 solver=str(opts.get("solver", "")))
        if not eq.converged:
            report.failures.append(f"equilibrium not found: {eq.solver} stopped at relative "
                                   f"residual {eq.max_residual:.3e}")
            if module is not None:
                report.notes.append("module output not judged: no equilibrium to compare it "
                                    "with")
            return report
        if cert is not None and not cert.holds:
            report.notes.append("the layer's uniqueness certificate does not hold here: the "
                                "references check that the point solves the inclusion only")
        ctx = InclusionContext(derived, src, inputs, env, outputs, opts, report)
        for b in range(out.shape[0]):
            for r in refs:
                r.run(ctx, b)
        if module is not None:
            _judge(report, module, derived, inputs, env, z, res.numpy())
        report.elapsed = time.perf_counter() - t0
        return report


def _judge(report: InclusionReport, module: EquilibriumModule, derived: DerivedLayer,
           inputs: dict[str, torch.Tensor], env: dict[str, torch.Tensor], z: torch.Tensor,
           residuals: np.ndarray) -> None:
    """The module's own output against the LCP solution where there is one, else the tight
    solve (docs/theory.md §9.5); a failure joins the report's."""
    kinds = ", ".join(k for k in report.references if k == "lcp")
    against = Against(report.z_reference, f"the reference ({kinds or 'none'})",
                      report.tolerance, z, residuals, LCP_FLOOR)
    report.module = judge_module(module, derived, inputs, env, against)
    if report.module.failure:
        report.failures.append(report.module.failure)
    report.notes += [f"module forward warned: {w}" for w in report.module.warnings]
