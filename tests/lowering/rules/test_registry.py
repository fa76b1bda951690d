"""The rule registry: a user rule registered from outside the package lowers an objective no
built-in rule takes; derivations are values; one printer; claim kinds; ``Precomposed``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import models
from convex_eq.errors import LoweringError, OptionError
from convex_eq.precompose import Precomposed
from lowering.derived import DerivedLayer
from lowering.nodes import Combo, GradSum, Prox, Var
from lowering.rules import LowerContext, Match, Rule
from lowering.rules.common import certificate, claim_from_certificate
from lowering.trace import ClaimKind, Contraction, Derivation, Step
from verify.check import check


# ------------------------------------------------------------------ a rule written by a user
@dataclasses.dataclass(frozen=True)
class BoxL1Match(Match):
    l1: Any
    box: Any
    smooth: tuple[Any, ...]


class BoxL1ForwardBackward:
    """``c||z||₁ + ι_{||z||∞ ≤ r} + h(z)`` ⇒ ``z ← clip(soft_c(z − ∇h(z)), −r, r)`` (step 1/L,
    L = 1): in 1-D ``prox_{ι_[−r,r] + c|·|} = clip ∘ soft_c``."""

    name = "user: box + ℓ1 forward–backward"

    def match(self, obj: Any) -> BoxL1Match | None:
        if not isinstance(obj, ce.Objective) or len(obj.states) != 1:
            return None
        l1 = [t for t in obj.terms if isinstance(t, ce.L1)]
        box = [t for t in obj.terms if type(t).__name__ == "LinfBallIndicator"]
        rest = tuple(t for t in obj.terms if t not in (*l1, *box))
        if len(l1) != 1 or len(box) != 1 or not all(t.smooth for t in rest):
            return None
        if sum(t.grad_lipschitz(None) for t in rest) != 1.0:
            return None
        return BoxL1Match(obj, l1[0], box[0], rest)

    def lower(self, m: BoxL1Match, ctx: LowerContext) -> DerivedLayer:
        obj = m.objective
        z = obj.states[0]
        step = Combo([(1.0, Var(z)), (1.0, GradSum(list(m.smooth), z, sign=-1.0))])
        node = Prox(m.box, Prox(m.l1, step))
        d = Derivation().then(Step(self.name, "h smooth with Lip(∇h) = 1; step 1",
                                   ("G = ", obj), (z, " ← ", node)))
        cert = certificate(obj)
        claim = claim_from_certificate(obj, cert, f"minimizer of G = {obj}")
        return DerivedLayer(source=obj, blocks=[z], nodes={z.name: node}, derivation=d,
                            claim=claim, contraction=Contraction("1", "1", lambda env: 1.0),
                            certificate=cert)


def _box_l1_objective() -> tuple[ce.Objective, ce.State, ce.Input, np.ndarray]:
    rng = np.random.default_rng(3)
    z, x = ce.State("z", 6), ce.Input("x", 4)
    u = rng.normal(size=(6, 4))
    U = ce.Weight("U", (6, 4), u)
    obj = ce.SqNorm(z - U @ x) + 0.3 * ce.L1(z) + ce.terms.l1.LinfBallIndicator(z, radius=0.8)
    return obj, z, x, u


def test_user_rule_from_outside_lowers_what_no_builtin_rule_takes() -> None:
    obj, _z, _x, u = _box_l1_objective()
    with pytest.raises(LoweringError, match="several non-smooth terms"):
        lowering.lower(obj)
    rule = BoxL1ForwardBackward()
    assert isinstance(rule, Rule)
    lowering.register_rule(rule)
    try:
        with pytest.raises(OptionError, match="already registered"):
            lowering.register_rule(rule)
        d = lowering.lower(obj)
    finally:
        lowering.unregister_rule(rule.name)
    assert d.derivation.rules() == [rule.name]
    assert d.claim.kind is ClaimKind.MINIMIZER
    gen = torch.Generator().manual_seed(0)
    zs, xs = (torch.randn(5, n, generator=gen, dtype=torch.float64) for n in (6, 4))
    v = zs - (zs - xs @ torch.as_tensor(u).T)  # z − ∇½||z − Ux||²
    soft = torch.sign(v) * torch.clamp(v.abs() - 0.3, min=0.0)
    # both sides evaluate the same closed form in float64: rounding only
    torch.testing.assert_close(d.apply({"z": zs, "x": xs})["z"], soft.clamp(-0.8, 0.8),
                               atol=1e-12, rtol=1e-12)
    rep = check(d, xs[:3].numpy())
    assert rep.passed and rep.reference.kind == "cvxpy", rep
    with pytest.raises(LoweringError):  # unregistered again: the default registry is as before
        lowering.lower(obj)


def test_register_before_a_builtin_takes_precedence() -> None:
    phi = models.opteq(n=4, m=4, d=2, form="conjugate", seed=0)

    class Shadow:
        name = "shadow"

        def match(self, obj: Any) -> Match | None:
            return Match(obj) if obj is phi else None

        def lower(self, m: Match, ctx: LowerContext) -> DerivedLayer:
            base = ctx.registry.find(phi)
            assert base is not None and base[0].name == "shadow"
            raise LoweringError("shadowed", term="shadow")

    lowering.register_rule(Shadow(), before="theorem1")
    try:
        with pytest.raises(LoweringError, match="shadowed"):
            lowering.lower(phi)
    finally:
        lowering.unregister_rule("shadow")
    assert lowering.lower(phi).derivation.rules()[0].startswith("Theorem 1")
    with pytest.raises(OptionError, match="no rule named"):
        lowering.register_rule(Shadow(), after="nonexistent")


# ------------------------------------------------------------------ derivations are values
def test_regularizer_edit_leaves_the_base_layer_unchanged() -> None:
    from lowering.rules import regularizers, theorem1

    phi = models.opteq(n=5, m=5, d=2, form="conjugate", seed=1)
    z = phi.states[0]
    m = theorem1.match(phi + 0.1 * ce.L1(z))
    base = theorem1.lower_base(m)
    before = base.derivation
    edited = regularizers.apply_edits(base, list(m.rest), "auto")
    assert base.derivation is before and len(before.steps) == 1
    assert len(edited.derivation.steps) == 2 and edited.payload.base is base
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.steps = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        edited.claim.kind = ClaimKind.STATIONARY  # type: ignore[misc]


def test_one_printer_for_text_and_latex() -> None:
    phi = models.opteq(n=5, m=5, d=2, form="conjugate", seed=1)
    d = lowering.lower(phi + 0.1 * ce.L1(phi.states[0]))
    text, tex = d.derivation.text(), d.derivation.latex()
    assert "prox_φ(z) = ∇ψ(z)" in text
    assert "\\mathrm{prox}_\\varphi (z) = \\nabla \\psi (z)" in tex
    # formulas (not the prose notes in \text{…}) are LaTeX, not unicode
    math_lines = [ln.split("\\text{note")[0] for ln in tex.splitlines() if "Longrightarrow" in ln]
    assert math_lines and not any(c in ln for ln in math_lines for c in "∇φψσ←−")


def test_claim_kind_is_an_enum_equal_to_its_text() -> None:
    d = lowering.lower(models.opteq(n=4, m=4, d=2, form="conjugate", seed=0))
    assert d.claim.kind is ClaimKind.MINIMIZER and d.claim.kind == "minimizer"
    assert ClaimKind.MINIMIZER.needs_certificate and not ClaimKind.STATIONARY.needs_certificate


def test_precomposed_is_a_type() -> None:
    g = models.opteq(n=4, m=4, d=2, seed=0)
    pc = ce.precompose(g, np.eye(4) * 2.0)
    assert isinstance(pc, Precomposed) and pc.precomposition is pc and pc.inner is g
    assert pc.orthogonality_defect() == pytest.approx(3.0)  # ||4I − I||₂
    d = lowering.lower(pc)
    assert d.payload.inner.source is g


def test_readme_derivation_excerpt_is_the_printers_output() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict[str, Any] = {}
    exec(compile(code.split("layer = lowering.lower(phi)")[0], "README.md", "exec"), ns)
    d = lowering.lower(ns["phi"])
    excerpt = readme.split("prints the certificate and the derivation:\n\n```text\n", 1)[1]
    excerpt = excerpt.split("```", 1)[0]
    assert excerpt.rstrip("\n").endswith(d.describe())
