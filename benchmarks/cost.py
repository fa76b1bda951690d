"""Case 4: time to lower each seed model, and to verify one instance against CVXPY."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .common import Config, median, rel_err


class _Skip(Exception):
    """A measurement left out in ``--quick`` mode."""


def seed_models() -> dict[str, Callable[[], Any]]:
    """The seed models of ``convex_eq.models`` (default sizes) plus OptEq + 0.1·||z||₁."""
    import convex_eq as ce
    from convex_eq import models

    def opteq_l1() -> Any:
        phi = models.opteq(form="canonical")
        return phi + 0.1 * ce.L1(phi.states[0])

    return {
        "opteq (canonical)": lambda: models.opteq(form="canonical"),
        "opteq (conjugate)": lambda: models.opteq(form="conjugate"),
        "deep opteq L=2": lambda: models.deep_opteq(L=2),
        "deep opteq L=3": lambda: models.deep_opteq(L=3),
        "geq": lambda: models.geq(),
        "geq-patch": lambda: models.geq(n=16, p=16, patch=2, image=(1, 4, 4)),
        "mopteq": lambda: models.mopteq(),
        "opteq + L1": opteq_l1,
    }


def _input(obj: Any, seed: int) -> np.ndarray:
    ins = obj.inputs if hasattr(obj, "inputs") else [s for s in obj.symbols if s.kind == "input"]
    return np.random.default_rng(seed).standard_normal((1, ins[0].size))


def _direct(obj: Any, layer: Any, x: np.ndarray, device: torch.device) -> tuple[float, str]:
    """Export the instance, solve it with Clarabel, compare with the emitted module's output
    (computed on ``device``)."""
    if not hasattr(obj, "to_cvxpy"):
        return float("nan"), "no to_cvxpy (composition)"
    mod = layer.torch_module(dtype=torch.float64, on_nonconvergence="warn").to(device)
    name = mod.input_syms[0].name
    with torch.no_grad():
        out = mod(torch.as_tensor(x, device=device))
    blocks = out if isinstance(out, tuple) else (out,)
    z = torch.cat([b.reshape(1, -1) for b in blocks], dim=1)
    ex = obj.to_cvxpy(**{name: x[0]})
    ex.solve()
    vals = ex.state_values()
    ref = np.concatenate([vals[b.name].reshape(-1) for b in mod.blocks])[None]
    return rel_err(z, ref), ""


def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Per seed model: lowering time (median), verify time via ``verify.check`` if importable and
    via the direct CVXPY path (export + Clarabel + comparison).  Lowering (sympy), CVXPY and
    ``verify.check`` are CPU work; only the emitted module of the direct path runs on
    ``cfg.device``."""
    import lowering

    try:
        from verify.check import check
    except Exception as err:  # verify.check is optional here
        check, check_err = None, f"{type(err).__name__}: {err}"
    else:
        check_err = ""
    rows = []
    for name, build in seed_models().items():
        obj = build()
        row: dict[str, Any] = {"model": name}
        try:
            times = []
            for _ in range(max(cfg.cost_reps, 1)):
                t0 = time.perf_counter()
                layer = lowering.lower(obj)
                times.append(time.perf_counter() - t0)
            row["lower_s"], row["lower_times"] = median(times), times
            steps = getattr(layer.derivation, "steps", [])
            row["rule"] = steps[0].rule if steps else ""
        except Exception as err:
            row["lower_error"] = f"{type(err).__name__}: {err}"
            rows.append(row)
            continue
        x = _input(obj, cfg.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if cfg.verify_models is not None and name not in cfg.verify_models:
                    raise _Skip("skipped (--quick)")
                t0 = time.perf_counter()
                err_, note = _direct(obj, layer, x, torch.device(cfg.device))
                row["direct_s"] = time.perf_counter() - t0 if not note else float("nan")
                row["direct_err"], row["direct_note"] = err_, note
            except _Skip as err:
                row["direct_s"], row["direct_note"] = float("nan"), str(err)
            except Exception as err:
                row["direct_s"], row["direct_note"] = float("nan"), f"{type(err).__name__}: {err}"
            if cfg.verify_models is not None and name not in cfg.verify_models:
                row["check_status"] = "skipped (--quick)"
            elif check is not None:
                try:
                    t0 = time.perf_counter()
                    rep = check(layer, x)
                    row["check_s"] = time.perf_counter() - t0
                    row["check_passed"] = bool(rep.passed)
                    row["check_status"] = str(getattr(rep, "status", ""))[:200]
                    row["check_reference"] = str(getattr(rep.reference, "kind", ""))[:60]
                except Exception as err:
                    row["check_s"] = float("nan")
                    row["check_status"] = f"{type(err).__name__}: {err}"[:200]
            else:
                row["check_status"] = f"verify.check not importable ({check_err})"[:200]
        rows.append(row)
        log(f"  cost {name}: lower {row.get('lower_s', float('nan')) * 1e3:.1f} ms, "
            f"verify {row.get('check_s', float('nan')):.2f} s, direct "
            f"{row.get('direct_s', float('nan')):.2f} s")
    return {"rows": rows, "device": cfg.device}
