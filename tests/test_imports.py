"""Lazy imports: declaring, lowering and running a layer loads no cvxpy, sympy or scipy, and
declaring and printing an objective loads no torch either.

Each check runs in a fresh interpreter (``sys.modules`` of the test process already holds
everything); the heavy libraries are allowed exactly where a user asks for them: an export
(``to_cvxpy``), a symbolic activation (``from_sympy``) or ``verify``.  (The first backward pass
does load sympy: torch's own ``autograd.grad(..., grad_outputs)`` imports it, torch 2.13.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("cvxpy", "sympy", "scipy", "clarabel", "scs", "matplotlib", "hypothesis")


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter at the repository root; return its stdout."""
    prelude = f"import sys\nHEAVY = {HEAVY!r}\n"
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_import_and_emitted_module_load_no_heavy_dependency() -> None:
    out = _run("""
        import convex_eq, lowering
        print(sorted(m for m in HEAVY if m in sys.modules))
        import torch
        from convex_eq import models
        phi = models.opteq(n=6, m=6, d=4, activation="relu", form="conjugate", seed=0)
        module = lowering.lower(phi).torch_module()
        z = module(torch.randn(3, 4))
        assert z.shape == (3, 6), z.shape
        print(sorted(m for m in HEAVY if m in sys.modules))
    """)
    after_import, after_forward = out.strip().splitlines()[-2:]
    assert after_import == "[]", f"eager import came back: {after_import}"
    assert after_forward == "[]", f"lowering or the forward pass imported {after_forward}"


def test_import_declare_and_print_load_no_torch() -> None:
    """The symbolic layer needs no numerics: torch comes with the first value, norm or lowering."""
    out = _run("""
        HEAVY = HEAVY + ("torch",)
        import convex_eq as ce
        print(sorted(m for m in HEAVY if m in sys.modules))
        z, x = ce.State("z", 4), ce.Input("x", 3)
        W, U = ce.Weight("W", (4, 4), seed=1), ce.Weight("U", (4, 3))
        b, lam = ce.Constant("b", [0.5] * 4), ce.Scalar("lam", 0.1, low=0.0)
        WW = (ce.Dense(W) @ ce.Dense(W)).T  # composition and transpose
        phi = ce.objective(0.5 * ce.SqNorm(z) - ce.Linear(U @ x + b, z) + ce.Potential("relu", z)
                           + lam * ce.L1(z) + ce.Antiderivative("tanh", WW @ z + U @ x))
        print(phi, phi.latex(), ce.conjugate(ce.Antiderivative("relu", W @ z + b)), file=sys.stderr)
        print(ce.models.opteq(n=8, m=8, d=4, activation="relu", form="conjugate"), file=sys.stderr)
        for bad in ([1.0, float("nan")], [1.0, 2.0, 3.0]):
            try:
                ce.Constant("c", bad) if len(bad) == 2 else ce.Weight("V", 2, value=bad)
            except (ce.NonFiniteError, ce.ShapeError) as err:
                print(type(err).__name__, file=sys.stderr)
        print(sorted(m for m in HEAVY if m in sys.modules))
        import torch
        g = torch.Generator().manual_seed(1)  # the value W was declared with, made on first read
        assert torch.equal(W.value, torch.randn(4, 4, generator=g, dtype=torch.float64) / 2.0)
    """)
    after_import, after_declare = out.strip().splitlines()[-2:]
    assert after_import == "[]", f"import convex_eq imported {after_import}"
    assert after_declare == "[]", f"declaring and printing an objective imported {after_declare}"


def test_algebra_constructors_are_registered_and_missing_ones_named() -> None:
    from convex_eq import ConvexEqError, State, _algebra

    assert set(_algebra._BUILDERS) == set(_algebra.OPERATIONS)  # import convex_eq registers all
    z, y = State("z", 2), State("y", 2)
    saved = dict(_algebra._BUILDERS)
    try:
        _algebra._BUILDERS.pop("affine")
        with pytest.raises(ConvexEqError, match="convex_eq.affine has not been imported"):
            _ = z + y
    finally:
        _algebra._BUILDERS.update(saved)
    assert str(z + y) == "z + y"


def test_export_and_symbolic_activation_load_on_demand() -> None:
    out = _run("""
        import convex_eq
        from convex_eq import models
        phi = models.opteq(n=4, m=4, d=3, activation="relu", form="conjugate", seed=0)
        before = "cvxpy" in sys.modules
        phi.to_cvxpy(x=[0.1, 0.2, 0.3])
        s = "sympy" in sys.modules
        import sympy
        t = sympy.Symbol("t")
        act = convex_eq.from_sympy(t / (1 + abs(t)) / 2 + t / 2, t)
        print(before, "cvxpy" in sys.modules, s, "sympy" in sys.modules, act.lipschitz)
    """)
    before, after, s_before, s_after, lip = out.split()
    assert (before, after, s_before, s_after) == ("False", "True", "False", "True")
    assert float(lip) == 1.0  # sup σ' = 1/2 + 1/2 exactly (symbolic)


def test_not_dcp_error_is_a_cvxpy_dcp_error_in_either_import_order() -> None:
    for first in ("import convex_eq, cvxpy", "import cvxpy, convex_eq"):
        out = _run(f"""
            {first}
            from convex_eq import NotDCPError, ExportError
            err = NotDCPError("not DCP", term="t")
            try:
                raise err
            except cvxpy.error.DCPError as caught:
                print(issubclass(NotDCPError, ExportError), caught is err)
        """)
        assert out.split() == ["True", "True"], first


def test_help_loads_no_heavy_dependency() -> None:
    out = _run("""
        from convex_eq_app.cli import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        for cmd in ("derive", "verify", "demo", "tour", "bench"):
            try:
                main([cmd, "--help"])
            except SystemExit:
                pass
        print(sorted(m for m in HEAVY + ("torch",) if m in sys.modules))
    """)
    assert out.strip().splitlines()[-1] == "[]", out


def test_verify_properties_import_without_hypothesis() -> None:
    out = _run("""
        sys.modules["hypothesis"] = None  # as on a plain install: import hypothesis fails
        import verify.properties as P
        from verify.properties.cases import opteq_case
        print(len(P.PROPERTIES))
        try:
            P.PROPERTIES[0].strategy()
        except ImportError as err:
            print("refused:", err)
    """)
    count, refused = out.strip().splitlines()
    assert int(count) > 0
    assert refused.startswith("refused:") and "pip install 'convex-eq[test]'" in refused


def test_derive_of_each_example_loads_no_torch_and_emitting_loads_the_runtime() -> None:
    """``convex-eq derive FILE:NAME`` (text and LaTeX) derives and prints without torch: the
    certificate's norms are measured on the declared numpy values; the first ``torch_module()``
    then imports the runtime and the module runs."""
    out = _run("""
        import contextlib, io
        from convex_eq_app.cli import main
        names = ("opteq_relu", "opteq_l1", "opteq_tanh", "deep2", "geq")
        for name in names:
            for extra in ([], ["--latex"]):
                with contextlib.redirect_stdout(io.StringIO()) as text:
                    assert main(["derive", f"examples/models.py:{name}", *extra]) == 0
                assert "derivation" in text.getvalue() or "\\\\" in text.getvalue(), name
        print(sorted(m for m in HEAVY + ("torch", "lowering.runtime") if m in sys.modules))
        import lowering
        from convex_eq import models
        layer = lowering.lower(models.opteq(n=6, m=6, d=4, form="conjugate", seed=0))
        print(sorted(m for m in ("torch", "lowering.runtime") if m in sys.modules))
        module = layer.torch_module()
        import torch
        assert module(torch.randn(2, 4)).shape == (2, 6)
        print(type(module).__name__, lowering.ModuleConfig.__module__)
    """)
    after_derive, after_lower, emitted = out.strip().splitlines()[-3:]
    assert after_derive == "[]", f"derive imported {after_derive}"
    assert after_lower == "[]", f"lowering.lower imported {after_lower}"
    assert emitted == "EquilibriumModule lowering.runtime.config"


def test_runtime_names_of_lowering_load_on_first_use() -> None:
    out = _run("""
        import lowering
        print("lowering.runtime" in sys.modules, "torch" in sys.modules)
        print(set(lowering.__all__) <= set(dir(lowering)))
        from lowering import SolveConfig, convert
        print("lowering.runtime" in sys.modules, SolveConfig.__name__, convert.__name__)
        try:
            lowering.no_such_name
        except AttributeError as err:
            print("AttributeError", err)
    """)
    before, listed, after, missing = out.strip().splitlines()[-4:]
    assert before == "False False"
    assert listed == "True"
    assert after == "True SolveConfig convert"
    assert missing == "AttributeError module 'lowering' has no attribute 'no_such_name'"
    # the subpackage as an attribute of a fresh `import lowering`, as before it was lazy
    out = _run("""
        import lowering
        print(lowering.runtime.module.EquilibriumModule.__name__)
    """)
    assert out.strip().splitlines()[-1] == "EquilibriumModule"


def test_threads_emitting_their_first_modules_at_once_load_the_runtime_once() -> None:
    out = _run("""
        import threading
        import lowering
        from convex_eq import models
        layer = lowering.lower(models.opteq(n=6, m=6, d=4, form="conjugate", seed=0))
        errors, start = [], threading.Barrier(4)

        def emit():
            start.wait()
            try:
                layer.torch_module()
            except Exception as err:
                errors.append(repr(err))

        threads = [threading.Thread(target=emit) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(errors)
    """)
    assert out.strip().splitlines()[-1] == "[]"
