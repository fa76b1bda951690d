"""Hypothesis strategies for random objective trees built from every term of the language.

``well_formed()`` draws a :class:`Case`: an objective (or a deep composition) that is a legal
sentence of the language — every constructor accepts it — from one of the families

* ``canonical``  — ``Σ_b f_σb(z_b) + ½||z_b||² − S(z)`` with 1–3 blocks (vector or ``(C, H, W)``),
  ``S`` drawn from linear injections, ``½||Wz||²`` (dense or convolutional ``W``), Gaussian and
  patch-Gaussian kernels, quadratic forms, couplings / channel decorrelation between blocks,
  feature incay, batch decorrelation, HSIC, Moreau envelopes, ℓ1 (extra prox);
* ``theorem1``   — conjugate-form OptEq ``ψ* − ½||·||²`` plus regularizer edits, with a random
  ``regularizer=`` option;
* ``moreau``     — ``λ·M_φ^μ`` of a lowerable ``φ`` (skip rule ``μ + λ = 1`` or general ``μ, λ``);
* ``precompose`` — ``φ∘A`` (``convex_eq.precompose``) of a canonical or forward–backward ``φ``,
  possibly nested;
* ``deep``       — ``DeepComposition`` of 1–3 Theorem-1 layers, ``deep_form`` option;
* ``fb``         — one prox-able term plus smooth terms (forward–backward fallback);
* ``random``     — a random bag of terms on 1–2 blocks (lowerable or not);

with random activations (registry, random parameters, sympy-derived via ``from_sympy``), shapes,
spectral norms and scales.  Such a case may still be *unsupported* by the lowering (the property
is then that ``lower`` raises a documented error naming the term).

``malformed()`` draws a :class:`Malformed`: a thunk that builds / lowers / evaluates something
illegal (shape mismatches, invalid scales, non-monotone or non-1-Lipschitz sympy σ, unsupported
compositions, bad runtime arguments) with the strings the error message must contain.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy as sp
import torch
from hypothesis import strategies as st

import convex_eq as ce
import lowering
from convex_eq import (
    HSIC,
    L1,
    Antiderivative,
    AntiderivativeConjugate,
    BatchDecorrelation,
    ChannelDecorrelation,
    Constant,
    Coupling,
    DeepComposition,
    FeatureIncay,
    GaussianKernel,
    Input,
    Linear,
    LinfBallIndicator,
    Objective,
    PatchGaussianKernel,
    Potential,
    QuadraticForm,
    Scalar,
    SqNorm,
    State,
    Weight,
    models,
    moreau,
    precompose,
)
from convex_eq.affine import as_affine
from convex_eq.operators import Conv2d, Dense, downsample_or_identity

REGISTRY = ("identity", "relu", "leaky_relu", "hardtanh", "clamp", "tanh", "sigmoid", "softplus")
#: valid user activations (nondecreasing, 1-Lipschitz) derived once per session with sympy
SYMPY_VALID = {"half": "t/2", "atan": "atan(t)"}
#: invalid user activations and the condition their refusal must name
SYMPY_INVALID = {
    "-t": "nondecreasing", "2*t": "1-Lipschitz", "sin(t)": "nondecreasing",
    "t**3": "1-Lipschitz", "exp(t)": "1-Lipschitz", "t**2": "nondecreasing",
    "tanh(2*t)": "1-Lipschitz", "-atan(t)": "nondecreasing", "t + sin(t)": "1-Lipschitz",
    "2*atan(t)": "1-Lipschitz", "t/2 - cos(t)": "1-Lipschitz", "-exp(-t**2)": "nondecreasing",
    "t - t**3/3": "nondecreasing", "3*t/2 + 1": "1-Lipschitz", "sqrt(t)": "real",
    "log(t)": "real", "0*t + 1": "constant",
}

FAMILIES = ("canonical", "theorem1", "moreau", "precompose", "deep", "fb", "random")


@functools.cache
def sympy_activation(key: str) -> Any:
    """A valid sympy-derived activation (built once: sympy derivations take ~1 s)."""
    t = sp.Symbol("t")
    return ce.from_sympy(sp.sympify(SYMPY_VALID[key], locals={"t": t}), t, name=f"sympy_{key}")


# ----------------------------------------------------------------------------- drawn cases
@dataclass
class Case:
    """One drawn well-formed sentence of the objective language."""

    family: str
    obj: Any  # Objective | DeepComposition
    inputs: dict[str, np.ndarray]  # batched (B, *shape)
    batch: int
    options: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    seed: int = 0

    @property
    def objective(self) -> Objective | None:
        return self.obj if isinstance(self.obj, Objective) else None

    def input_tensors(self) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v, dtype=torch.float64).reshape(self.batch, -1)
                for k, v in self.inputs.items()}

    def __repr__(self) -> str:  # readable falsifying examples
        try:
            text = str(self.obj)
        except Exception as err:  # printing itself is a property; keep repr robust
            text = f"<unprintable: {type(err).__name__}: {err}>"
        return (f"Case(family={self.family}, tags={self.tags}, B={self.batch}, "
                f"options={self.options}, seed={self.seed}, obj={text})")


class Builder:
    """Unique symbol names and seeded random weights for one drawn case."""

    def __init__(self, draw: Any, seed: int):
        self.draw = draw
        self.rng = np.random.default_rng(seed)
        self.k = 0
        self.x: Input | None = None
        self.d = draw(st.integers(1, 4))
        self.tags: list[str] = []
        self.image_ok = True
        #: no Moreau envelopes (their CVXPY ``declare`` makes precomposition refuse them)
        self.no_envelope = False

    # ------------------------------------------------------------- names & scalars
    def name(self, prefix: str) -> str:
        self.k += 1
        return f"{prefix}{self.k}"

    def tag(self, t: str) -> None:
        if t not in self.tags:
            self.tags.append(t)

    def norm(self) -> float:
        """A spectral norm: typical, at the boundary (0.999, 1) or beyond (non-convex)."""
        return self.draw(st.sampled_from((0.3, 0.9, 0.999, 1.0, 1.3))
                         | st.floats(0.01, 1.6, allow_nan=False))

    def pos(self, lo: float = 0.05, hi: float = 3.0) -> float:
        return self.draw(st.sampled_from((1.0, 0.5)) | st.floats(lo, hi, allow_nan=False))

    def coef(self, name: str, lo: float = 0.05, hi: float = 2.0) -> float | Scalar:
        """A positive coefficient, sometimes a ``Scalar`` symbol with a declared range."""
        v = self.pos(lo, hi)
        if self.draw(st.integers(0, 4)) == 0:
            return Scalar(self.name(name), v, low=0.0, low_open=True)
        return v

    # ------------------------------------------------------------- symbols
    def state(self, image: bool | None = None) -> State:
        if image is None:
            image = self.image_ok and self.draw(st.integers(0, 3)) == 0
        if image:
            c = self.draw(st.sampled_from((1, 2)))
            h = self.draw(st.sampled_from((2, 4)))
            w = self.draw(st.sampled_from((2, 4)))
            self.tag("image")
            return State(self.name("z"), (c, h, w))
        return State(self.name("z"), self.draw(st.integers(1, 6)))

    def input(self) -> Input:
        if self.x is None:
            self.x = Input("x", self.d)
        return self.x

    def weight(self, shape: tuple[int, ...], norm: float | None = None, prefix: str = "W",
               constant: bool = False) -> Any:
        a = self.rng.standard_normal(shape)
        if len(shape) == 2:
            n = float(np.linalg.norm(a, 2))
            a = a * ((self.norm() if norm is None else norm) / max(n, 1e-12))
        else:
            a = a / math.sqrt(max(1, a.size // shape[0]))
        if constant:
            return Constant(self.name(prefix), a)
        return Weight(self.name(prefix), shape, a)

    def op(self, z: State, out: int | None = None, norm: float | None = None) -> Any:
        """A linear operator on ``z``: dense ``(out, n)``, or a convolution for image states."""
        if len(z.shape) == 3 and out is None and self.draw(st.booleans()):
            c = z.shape[0]
            cout = self.draw(st.sampled_from((1, 2)))
            k = self.draw(st.sampled_from((1, 3)))
            w = Weight(self.name("K"), (cout, c, k, k), self.rng.standard_normal((cout, c, k, k)))
            op = Conv2d(w, in_shape=z.shape, padding=k // 2)
            target = self.norm() if norm is None else norm
            w.value = w.value * (target / max(op.norm(), 1e-12))
            self.tag("conv")
            return op
        m = out if out is not None else self.draw(st.integers(1, 6))
        return Dense(self.weight((m, z.size), norm))

    def injection(self, size: int) -> Any:
        """``q = U x + b``, ``U x`` or ``b``."""
        kind = self.draw(st.sampled_from(("Ux+b", "Ux+b", "Ux", "b")))
        b = Weight(self.name("b"), (size,), 0.3 * self.rng.standard_normal(size))
        if kind == "b":
            return as_affine(b)
        u = self.weight((size, self.d), self.pos(0.2, 1.5), prefix="U")
        q = u @ self.input()
        return q + b if kind == "Ux+b" else q

    def activation(self, allow_sympy: bool = True) -> Any:
        return self.draw(activations(allow_sympy))


@st.composite
def activations(draw: Any, allow_sympy: bool = True) -> Any:
    """A registry activation with random parameters, or a valid sympy-derived one."""
    kinds = REGISTRY + (("sympy",) if allow_sympy else ())
    k = draw(st.sampled_from(kinds))
    if k == "leaky_relu":
        slope = draw(st.sampled_from((1e-3, 0.01, 0.3, 1.0)) | st.floats(1e-3, 1.0))
        return ce.get_activation(k, slope=slope)
    if k in ("hardtanh", "clamp"):
        lo = draw(st.sampled_from((-1.0,)) | st.floats(-3.0, 1.0))
        hi = lo + draw(st.floats(0.05, 3.0))
        return ce.get_activation(k, lo=lo, hi=hi)
    if k == "sympy":
        return sympy_activation(draw(st.sampled_from(sorted(SYMPY_VALID))))
    return ce.get_activation(k)


# ----------------------------------------------------------------------------- term menus
def _prox_inner(b: Builder, z: State) -> Objective:
    """A single-state objective with a closed-form prox (inner function of an envelope)."""
    kind = b.draw(st.sampled_from(("l1", "linf", "potential", "sq", "l1+lin", "potential+sq",
                                   "l1-sq")))
    if kind == "l1":
        return Objective([L1(z) * b.pos()])
    if kind == "linf":
        return Objective([LinfBallIndicator(z, b.pos(0.1, 2.0))])
    if kind == "potential":
        return Objective([Potential(b.activation(), z)])
    if kind == "sq":
        return Objective([SqNorm(z) * b.pos()])
    if kind == "l1+lin":
        return Objective([L1(z) * b.pos(), Linear(b.injection(z.size), z)])
    if kind == "l1-sq":  # weakly convex: the quadratic is negative
        b.tag("weakly-convex-inner")
        return Objective([L1(z) * b.pos(), SqNorm(z) * -b.pos(0.05, 0.45)])
    return Objective([Potential(b.activation(), z), SqNorm(z) * b.pos()])


def smooth_terms(b: Builder, z: State, n: int) -> list[Any]:
    """``n`` terms of ``-S`` on block ``z`` (as they appear in ``G``)."""
    menu = ["linear", "gram", "gram", "gauss", "quadform", "incay", "l1"]
    if not b.no_envelope:
        menu.append("moreau")
    if z.size >= 2:
        menu += ["batchdecor", "hsic"]
    if len(z.shape) == 3:
        menu += ["patch", "patch"]
    out: list[Any] = []
    for _ in range(n):
        kind = b.draw(st.sampled_from(menu))
        b.tag(kind)
        sign = -1.0 if b.draw(st.integers(0, 5)) else 1.0
        if kind == "linear":
            t = Linear(b.injection(z.size), z)
            out.append(t * -1.0 if b.draw(st.booleans()) else t * b.coef("lam"))
        elif kind == "gram":
            out.append(SqNorm(b.op(z) @ z) * (-b.pos(0.1, 1.0)))
        elif kind == "gauss":
            p = b.draw(st.integers(1, 6))
            r = b.injection(p) - b.op(z, p) @ z
            out.append(GaussianKernel(r, b.coef("gamma", 0.05, 5.0)) * sign)
        elif kind == "patch":
            c, h, w = z.shape
            patch = b.draw(st.sampled_from([p for p in (1, 2, 4) if h % p == 0 and w % p == 0]))
            hh = b.draw(st.integers(1, 3))
            wh = b.weight((c * patch * patch, hh), b.pos(0.2, 1.5), prefix="Wh",
                          constant=b.draw(st.booleans()))
            wz = Dense(b.weight((z.size, z.size))) @ z
            t = PatchGaussianKernel(b.injection(z.size), wz, b.coef("gamma", 0.05, 5.0), patch,
                                    wh, z.shape)
            out.append(t * sign)
        elif kind == "quadform":
            a = b.rng.standard_normal((z.size, z.size))
            q = 0.5 * (a + a.T)
            if b.draw(st.booleans()):
                q = a @ a.T
            q = q / max(float(np.abs(np.linalg.eigvalsh(q)).max()), 1e-12) * b.pos(0.1, 1.2)
            out.append(QuadraticForm(Constant(b.name("Q"), q), z) * sign)
        elif kind == "incay":
            out.append(FeatureIncay(z, b.coef("eps", 0.2, 3.0)) * (b.pos(0.01, 0.5) * -sign))
        elif kind == "batchdecor":
            out.append(BatchDecorrelation(z) * b.pos(0.01, 0.5))
        elif kind == "hsic":
            out.append(HSIC(z, b.coef("sigma", 0.3, 3.0)) * b.pos(0.01, 0.5))
        elif kind == "moreau":
            out.append(moreau(_prox_inner(b, z), b.coef("mu", 0.1, 2.0)) * b.pos(0.05, 1.0))
        elif kind == "l1":
            out.append(L1(z) * b.coef("lam", 0.01, 1.0))
    return out


def pair_terms(b: Builder, zi: State, zj: State) -> list[Any]:
    """Coupling ``H`` and channel decorrelation ``D`` between two blocks (MOptEq)."""
    out: list[Any] = []
    if zi.shape == zj.shape:
        p = None
    else:
        try:
            p = downsample_or_identity(zj.shape, zi.shape)
        except ce.ShapeError:
            p = Dense(b.weight((zi.size, zj.size)))
    if b.draw(st.booleans()):
        b.tag("coupling")
        out.append(Coupling(zi, zj, p) * (-b.pos(0.05, 1.0)))
    if len(zi.shape) == 3 and zi.shape[0] >= 2 and b.draw(st.booleans()):
        b.tag("chandecor")
        out.append(ChannelDecorrelation(zi, zj, p) * b.pos(0.01, 0.3))
    return out


# ----------------------------------------------------------------------------- families
def canonical_terms(b: Builder, blocks: int | None = None, max_s: int = 3) -> list[Any]:
    nb = b.draw(st.integers(1, 3)) if blocks is None else blocks
    zs = [b.state() for _ in range(nb)]
    terms: list[Any] = []
    for z in zs:
        terms += [Potential(b.activation(), z), SqNorm(z)]
        terms += smooth_terms(b, z, b.draw(st.integers(0, max_s)))
    for i in range(nb):
        if nb > 1 and b.draw(st.booleans()):
            terms += pair_terms(b, zs[i], zs[(i + 1) % nb])
    return terms


def theorem1_terms(b: Builder, z: State | None = None, act: Any = None) -> list[Any]:
    """``ψ* − ½||z||²`` with ``ψ = (1/μ)Σσ̃(±Mz + q)``."""
    z = z if z is not None else b.state()
    act = act if act is not None else b.activation()
    m = b.draw(st.integers(1, 6))
    op = b.op(z, None if len(z.shape) == 3 else m)
    arg = op @ z
    if b.draw(st.integers(0, 5)) == 0:
        arg = arg * -1.0
        b.tag("negM")
    if b.draw(st.integers(0, 3)):
        arg = arg + b.injection(op.out_size)
    mu = b.pos(0.3, 2.0)
    psi = Antiderivative(act, arg) * (1.0 / mu)
    return [psi.conjugate(), -SqNorm(z)]


def regularizers(b: Builder, z: State, n: int) -> list[Any]:
    menu = ("sq", "l1", "linf", "incay", "moreau", "scalar_l1", "neg_sq", "neg_moreau")
    if z.size >= 2:
        menu = (*menu, "batchdecor", "hsic")
    out = []
    for _ in range(n):
        kind = b.draw(st.sampled_from(menu))
        b.tag("R_" + kind)
        if kind == "sq":
            out.append(SqNorm(z) * b.pos(0.05, 2.0))
        elif kind == "l1":
            out.append(L1(z) * b.pos(0.01, 1.0))
        elif kind == "neg_sq":
            out.append(SqNorm(z) * -b.pos(0.05, 0.5))
        elif kind == "neg_moreau":
            out.append(moreau(L1(z) * b.pos(0.05, 1.0), b.pos(0.5, 2.0)) * -b.pos(0.05, 0.3))
        elif kind == "scalar_l1":
            out.append(L1(z) * Scalar(b.name("lam"), b.pos(0.01, 1.0), low=0.0))
        elif kind == "linf":
            out.append(LinfBallIndicator(z, b.coef("r", 0.1, 3.0)))
        elif kind == "incay":
            out.append(FeatureIncay(z, b.coef("eps", 0.3, 3.0)) * b.pos(0.01, 0.3))
        elif kind == "moreau":
            out.append(moreau(L1(z) * b.pos(0.05, 1.0), b.pos(0.1, 2.0)) * b.pos(0.05, 1.0))
        elif kind == "batchdecor":
            out.append(BatchDecorrelation(z) * b.pos(0.01, 0.3))
        elif kind == "hsic":
            out.append(HSIC(z, b.pos(0.3, 3.0)) * b.pos(0.01, 0.3))
    return out


def fb_terms(b: Builder, z: State | None = None) -> list[Any]:
    """One prox-able non-smooth term plus 1–3 smooth terms on one block."""
    z = z if z is not None else b.state()
    kind = b.draw(st.sampled_from(("l1", "linf", "potential", "aconj", "pconj")))
    b.tag("g_" + kind)
    if kind == "l1":
        g = L1(z) * b.coef("lam", 0.05, 2.0)
    elif kind == "linf":
        g = LinfBallIndicator(z, b.pos(0.1, 3.0))
    elif kind == "potential":
        g = Potential(b.activation(), z) * b.pos(0.2, 3.0)
    elif kind == "aconj":
        g = AntiderivativeConjugate(b.activation(), z) * b.pos(0.2, 3.0)
    else:
        g = Potential(b.activation(), z).conjugate()
    h: list[Any] = []
    for _ in range(b.draw(st.integers(1, 3))):
        menu = ("sq", "gram", "linear", "gauss", "incay", "quad", "antider")
        hk = b.draw(st.sampled_from(menu if b.no_envelope else (*menu, "moreau")))
        b.tag("h_" + hk)
        if hk == "sq":
            h.append(SqNorm(z) * b.pos(0.1, 2.0))
        elif hk == "gram":
            h.append(SqNorm(b.op(z) @ z) * (b.pos(0.1, 1.0) * (-1 if b.draw(st.booleans())
                                                                 else 1)))
        elif hk == "linear":
            h.append(Linear(b.injection(z.size), z) * -1.0)
        elif hk == "gauss":
            p = b.draw(st.integers(1, 5))
            h.append(-GaussianKernel(b.injection(p) - b.op(z, p) @ z, b.pos(0.1, 3.0)))
        elif hk == "incay":
            h.append(FeatureIncay(z, b.pos(0.3, 3.0)) * b.pos(0.01, 0.3))
        elif hk == "quad":
            a = b.rng.standard_normal((z.size, z.size))
            h.append(QuadraticForm(Constant(b.name("Q"), a @ a.T / z.size), z) * b.pos(0.1, 1.0))
        elif hk == "moreau":
            h.append(moreau(_prox_inner(b, z), b.pos(0.1, 2.0)) * b.pos(0.05, 1.0))
        else:
            m = b.draw(st.integers(1, 5))
            h.append(Antiderivative(b.activation(), b.op(z, m) @ z + b.injection(m))
                     * b.pos(0.1, 1.0))
    return [g, *h]


def random_terms(b: Builder) -> list[Any]:
    """A random bag of 1–4 terms over 1–2 blocks (often not lowerable)."""
    zs = [b.state() for _ in range(b.draw(st.integers(1, 2)))]
    terms: list[Any] = []
    for _ in range(b.draw(st.integers(1, 4))):
        z = b.draw(st.sampled_from(zs))
        kind = b.draw(st.sampled_from(("pot", "sq", "l1", "linf", "lin", "gram", "aconj",
                                       "antider", "gauss", "incay", "moreau", "pair")))
        sc = b.draw(st.sampled_from((1.0, -1.0, 0.5, 2.0)))
        if kind == "pot":
            terms.append(Potential(b.activation(), z) * sc)
        elif kind == "sq":
            terms.append(SqNorm(z) * sc)
        elif kind == "l1":
            terms.append(L1(z) * sc)
        elif kind == "linf":
            terms.append(LinfBallIndicator(z, abs(sc)))
        elif kind == "lin":
            terms.append(Linear(b.injection(z.size), z) * sc)
        elif kind == "gram":
            terms.append(SqNorm(b.op(z) @ z) * sc)
        elif kind == "aconj":
            terms.append(AntiderivativeConjugate(b.activation(), z) * abs(sc))
        elif kind == "antider":
            m = b.draw(st.integers(1, 4))
            terms.append(Antiderivative(b.activation(), b.op(z, m) @ z) * sc)
        elif kind == "gauss":
            p = b.draw(st.integers(1, 4))
            terms.append(GaussianKernel(b.injection(p) - b.op(z, p) @ z, 1.0) * sc)
        elif kind == "incay":
            terms.append(FeatureIncay(z, 1.0) * sc)
        elif kind == "moreau":
            terms.append(moreau(_prox_inner(b, z), abs(sc)) * abs(sc))
        elif len(zs) > 1:
            terms += pair_terms(b, zs[0], zs[1])
    if not terms:
        terms.append(SqNorm(zs[0]))
    return terms


@st.composite
def well_formed(draw: Any, families: tuple[str, ...] = FAMILIES) -> Case:
    """A random well-formed objective tree (see the module docstring)."""
    family = draw(st.sampled_from(families))
    seed = draw(st.integers(0, 2**31 - 1))
    b = Builder(draw, seed)
    options: dict[str, Any] = {}
    obj: Any
    if family == "canonical":
        obj = Objective(draw(st.permutations(canonical_terms(b))), name="G")
    elif family == "theorem1":
        z = b.state()
        terms = theorem1_terms(b, z) + regularizers(b, z, draw(st.integers(0, 2)))
        obj = Objective(terms, name="phi")
        options["regularizer"] = draw(st.sampled_from(("auto", "auto", "prox", "gradient")))
    elif family == "moreau":
        kind = draw(st.sampled_from(("skip-theorem1", "skip-canonical", "general")))
        b.tag(kind)
        if kind == "general":
            inner = draw(st.sampled_from(("prox", "prox", "theorem1")))
            b.tag("inner-" + inner)
            z = b.state()
            phi = _prox_inner(b, z) if inner == "prox" else Objective(theorem1_terms(b, z))
            obj = Objective([moreau(phi, b.coef("mu", 0.1, 2.0)) * b.pos(0.05, 2.0)])
        else:
            alpha = draw(st.floats(0.05, 0.95))
            if kind == "skip-theorem1":
                phi = Objective(theorem1_terms(b))
            else:
                phi = Objective(canonical_terms(b, blocks=1, max_s=2))
            obj = Objective([moreau(phi, 1.0 - alpha) * alpha])
    elif family == "precompose":
        b.image_ok = False
        b.no_envelope = True
        inner = Objective(canonical_terms(b, blocks=1, max_s=2) if draw(st.booleans())
                          else fb_terms(b))
        obj = inner
        for _ in range(draw(st.integers(1, 2))):
            n = obj.states[0].size
            kind = draw(st.sampled_from(("orthogonal", "general", "diagonal", "permutation")))
            b.tag("M_" + kind)
            a = b.rng.standard_normal((n, n))
            if kind == "orthogonal":
                m = np.linalg.qr(a)[0]
            elif kind == "general":
                m = a + (1.0 + float(np.linalg.norm(a, 2))) * np.eye(n)
            elif kind == "diagonal":
                m = np.diag(b.rng.uniform(0.2, 3.0, n) * b.rng.choice([-1.0, 1.0], n))
            else:
                m = np.eye(n)[b.rng.permutation(n)]
            c = b.rng.standard_normal(n) if draw(st.booleans()) else None
            obj = precompose(obj, m, c, name=b.name("y"))
    elif family == "deep":
        b.image_ok = False
        n = draw(st.integers(1, 5))
        act = b.activation()
        layers = []
        for i in range(draw(st.integers(1, 3))):
            z = State(f"z{i}_{b.name('L')}", n)
            layers.append(Objective(theorem1_terms(b, z, act if draw(st.booleans()) else None),
                                    name=f"phi{i + 1}"))
        alpha: float | Scalar = draw(st.sampled_from((1.0, 0.5)) | st.floats(0.05, 1.0))
        if draw(st.integers(0, 3)) == 0:
            alpha = Scalar("alpha", float(alpha), low=0.0, low_open=True, high=1.0)
        obj = DeepComposition(layers, alpha)
        options["deep_form"] = draw(st.sampled_from(("composition", "multiblock")))
    elif family == "fb":
        obj = Objective(draw(st.permutations(fb_terms(b))), name="G")
        if draw(st.booleans()):
            h = [t for t in obj.terms if t.smooth]
            lip = sum(t.grad_lipschitz(None) for t in h)
            if math.isfinite(lip) and lip > 0:
                options["tau"] = draw(st.floats(0.05, 0.99)) * 2.0 / lip
    else:
        obj = Objective(random_terms(b), name="R")
    batch = draw(st.integers(1, 3))
    if any(t in b.tags for t in ("hsic", "R_hsic")):
        batch = max(batch, 2)  # HSIC is defined for batches of at least 2 (documented)
    inputs = {}
    if b.x is not None:
        inputs["x"] = b.rng.standard_normal((batch, b.d))
    return Case(family, obj, inputs, batch, options, b.tags, seed)


# ----------------------------------------------------------------------------- malformed
@dataclass
class Malformed:
    """An illegal construction / lowering / evaluation and what its error must name."""

    kind: str
    run: Callable[[], Any]
    names: tuple[str, ...]  # at least one must occur in the error message
    types: tuple[type, ...] = (ce.ConvexEqError,)

    def __repr__(self) -> str:
        return f"Malformed({self.kind}, must name one of {self.names})"


def _opteq_parts(b: Builder, n: int | None = None) -> tuple[Objective, State]:
    z = State(b.name("z"), n if n is not None else b.draw(st.integers(1, 5)))
    return Objective(theorem1_terms(b, z, ce.get_activation("relu")), name="phi"), z


def _canon(b: Builder, z: State) -> Objective:
    """The canonical OptEq objective with input ``x`` (``q = U x + b``)."""
    q = b.weight((z.size, b.d), 0.8, prefix="U") @ b.input() + Weight(b.name("b"), (z.size,))
    return Objective([Potential("relu", z), SqNorm(z), Linear(q, z) * -1.0,
                      SqNorm(b.op(z) @ z) * -0.5], name="G")


def _bad_scale(draw: Any) -> float:
    return draw(st.sampled_from((0.0, -1.0, -1e-9, math.nan, math.inf, -math.inf)))


def _malformed_cases(draw: Any, b: Builder) -> Malformed:
    kind = draw(st.sampled_from(MALFORMED_KINDS))
    n = draw(st.integers(1, 5))
    m = draw(st.integers(1, 5).filter(lambda k: k != n))
    z = State(b.name("z"), n)

    # ---------------------------------------------------------------- shape mismatches
    if kind == "linear_size":
        q = Weight(b.name("q"), (m,))
        return Malformed(kind, lambda: Linear(q, z), (q.name, z.name))
    if kind == "gram_size":
        w = Weight(b.name("W"), (draw(st.integers(1, 4)), m))
        return Malformed(kind, lambda: SqNorm(w @ z), (w.name,))
    if kind == "affine_sum":
        z2 = State(b.name("z"), m)
        return Malformed(kind, lambda: SqNorm(z + z2), (z.name, z2.name))
    if kind == "gauss_size":
        w = Weight(b.name("W"), (n, n))
        q = Weight(b.name("q"), (m,))
        return Malformed(kind, lambda: GaussianKernel(q - w @ z), (q.name, w.name))
    if kind == "coupling_P":
        z2 = State(b.name("z"), m)
        p = Weight(b.name("P"), (n, n))
        return Malformed(kind, lambda: Coupling(z, z2, p), ("Coupling", z.name, z2.name))
    if kind == "coupling_noP":
        z2 = State(b.name("z"), m)
        return Malformed(kind, lambda: Coupling(z, z2), ("Coupling",))
    if kind == "chandecor_channels":
        zi = State(b.name("z"), (3, 2, 2))
        return Malformed(kind, lambda: ChannelDecorrelation(zi, zi, channels=5),
                         ("ChannelDecorrelation", "Σ_k1", zi.name))
    if kind == "patch_divide":
        zi = State(b.name("z"), (1, 3, 3))
        wh = Weight(b.name("Wh"), (4, 2))
        return Malformed(kind, lambda: PatchGaussianKernel(zi, zi, 1.0, 2, wh, (1, 3, 3)),
                         ("patch", zi.name))
    if kind == "patch_wh":
        zi = State(b.name("z"), (1, 4, 4))
        wh = Weight(b.name("Wh"), (3, 2))
        return Malformed(kind, lambda: PatchGaussianKernel(zi, zi, 1.0, 2, wh, (1, 4, 4)),
                         (wh.name, zi.name))
    if kind == "quadform_shape":
        q = Constant(b.name("Q"), np.eye(m))
        return Malformed(kind, lambda: QuadraticForm(q, z), (q.name,))
    if kind == "quadform_asym":
        zz = State(b.name("z"), 2)
        q = Constant(b.name("Q"), [[1.0, 2.0], [0.0, 1.0]])
        return Malformed(kind, lambda: QuadraticForm(q, zz), (q.name,))
    if kind == "precompose_shape":
        phi = _canon(b, z)
        return Malformed(kind, lambda: precompose(phi, np.eye(m)), ("precompose",))
    if kind == "precompose_singular":
        phi = _canon(b, z)
        a = np.zeros((n, n))
        return Malformed(kind, lambda: precompose(phi, a), ("precompose",))
    if kind == "deep_sizes":
        p1, _ = _opteq_parts(b, n)
        p2, _ = _opteq_parts(b, m)
        return Malformed(kind, lambda: DeepComposition([p1, p2], 0.5, name="deepnet"),
                         ("deepnet",))
    if kind == "duplicate_names":
        z2 = State(z.name, n)
        return Malformed(kind, lambda: Objective([SqNorm(z), L1(z2)]), (z.name,))
    if kind == "bad_symbol_shape":
        return Malformed(kind, lambda: State("zbad", (n, 0)), ("zbad",))
    if kind == "nonfinite_weight":
        a = np.ones((n, n))
        a[0, 0] = draw(st.sampled_from((math.nan, math.inf)))
        return Malformed(kind, lambda: Weight("Wnan", (n, n), a), ("Wnan",))
    if kind == "scalar_as_vector":
        s = Scalar("lam_v", 1.0, low=0.0)
        return Malformed(kind, lambda: SqNorm(s), ("lam_v",))
    if kind == "no_state":
        x = Input("xin", n)
        t = draw(st.sampled_from(("l1", "incay", "gauss", "decor")))
        mk = {"l1": lambda: L1(x), "incay": lambda: FeatureIncay(x),
              "gauss": lambda: GaussianKernel(x), "decor": lambda: BatchDecorrelation(x)}[t]
        return Malformed(kind, mk, ("xin",))
    if kind == "conv_channels":
        w = Weight(b.name("K"), (2, 3, 3, 3))
        return Malformed(kind, lambda: Conv2d(w, in_shape=(2, 4, 4)), (w.name,))
    if kind == "downsample_channels":
        return Malformed(kind, lambda: downsample_or_identity((2, 4, 4), (3, 2, 2)),
                         ("(2, 4, 4)",))

    # ---------------------------------------------------------------- bad runtime arguments
    if kind == "value_shape":
        phi = _canon(b, z)
        bad = np.zeros((2, m))
        return Malformed(kind, lambda: phi.value(**{z.name: bad, "x": np.zeros((2, b.d))}),
                         (z.name,))
    if kind == "value_batch":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.value(**{z.name: np.zeros((3, n)),
                                                    "x": np.zeros((2, b.d))}),
                         ("batch",))
    if kind == "value_unknown":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.value(**{z.name: np.zeros(n), "x": np.zeros(b.d),
                                                    "bogus": 1.0}), ("bogus",))
    if kind == "value_weight_shape":
        phi = _canon(b, z)
        w = phi.weights[-1]
        return Malformed(kind, lambda: phi.value(**{z.name: np.zeros(n), "x": np.zeros(b.d),
                                                    w.name: np.zeros((m + 7,))}), (w.name,))
    if kind == "T_shape":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi).T(**{z.name: np.zeros((2, m)),
                                                                "x": np.zeros((2, b.d))}),
                         (z.name,))
    if kind == "T_batch":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi).T(**{z.name: np.zeros((3, n)),
                                                                "x": np.zeros((2, b.d))}),
                         ("batch",))
    if kind == "T_missing":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi).T(**{z.name: np.zeros((2, n))}),
                         ("x",))
    if kind == "export_missing_input":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.to_cvxpy(), ("'x'",))
    if kind == "export_state":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.to_cvxpy(**{z.name: np.zeros(n), "x": np.zeros(b.d)}),
                         (z.name,))
    if kind == "export_batch":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.to_cvxpy(x=np.zeros((2, b.d))), ("x",))
    if kind == "module_input_shape":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi).torch_module()(
            torch.zeros(2, b.d + 1)), ("'x'",))
    if kind == "module_input_nan":
        phi = _canon(b, z)
        bad = torch.zeros(2, b.d)
        bad[0, 0] = draw(st.sampled_from((math.nan, math.inf, -math.inf)))
        return Malformed(kind, lambda: lowering.lower(phi).torch_module()(bad), ("'x'",))
    if kind == "module_z0_shape":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi).torch_module()(
            torch.zeros(2, b.d), z0=torch.zeros(2, n + 1)), ("z0",))
    if kind == "module_batch":
        x2 = Input("x2", 2)
        phi = _canon(b, z) + Linear(Dense(Weight(b.name("V"), (n, 2))) @ x2, z) * -1.0
        return Malformed(kind, lambda: lowering.lower(phi).torch_module(dtype=torch.float64)(
            {"x": torch.zeros(3, b.d, dtype=torch.float64),
             "x2": torch.zeros(2, 2, dtype=torch.float64)}), ("batch",))
    if kind == "module_options":
        phi = _canon(b, z)
        opt = draw(st.sampled_from(({"solver": "bogus"}, {"tol": 0.0}, {"max_iter": 0},
                                    {"backward": "bogus"}, {"on_nonconvergence": "ignore"},
                                    {"backend": "bogus"})))
        key = next(iter(opt))
        return Malformed(kind, lambda: lowering.lower(phi).torch_module(**opt),
                         (key, str(opt[key])))

    # ---------------------------------------------------------------- invalid scales
    bad = _bad_scale(draw)
    if kind == "moreau_mu":
        phi = Objective([L1(z)])
        return Malformed(kind, lambda: moreau(phi, bad), ("M[",))
    if kind == "moreau_mu_env":
        mu = Scalar("mu_env", 0.5, low=0.0, low_open=True)
        phi = Objective([moreau(Objective([L1(z)]), mu)])
        return Malformed(kind, lambda: phi.value(**{z.name: np.zeros(n), "mu_env": -1.0}),
                         ("mu_env",))
    if kind == "gamma":
        q = Weight(b.name("q"), (n,))
        return Malformed(kind, lambda: GaussianKernel(q - z, bad), ("exp(",))
    if kind == "patch_gamma":
        zi = State(b.name("z"), (1, 2, 2))
        wh = Weight(b.name("Wh"), (4, 2))
        return Malformed(kind, lambda: PatchGaussianKernel(zi, zi, bad, 2, wh), (wh.name,))
    if kind == "incay_eps":
        return Malformed(kind, lambda: FeatureIncay(z, bad), (z.name,))
    if kind == "hsic_sigma":
        zz = State(b.name("z"), 3)
        return Malformed(kind, lambda: HSIC(zz, bad), ("HSIC",))
    if kind == "deep_alpha":
        p1, _ = _opteq_parts(b, n)
        alpha = draw(st.sampled_from((0.0, -0.5, 1.5, math.nan)))
        return Malformed(kind, lambda: DeepComposition([p1], alpha, name="deepnet"), ("deepnet",))
    if kind == "slope":
        s = draw(st.sampled_from((0.0, -0.1, 1.5, math.nan, "abc")))
        return Malformed(kind, lambda: ce.get_activation("leaky_relu", slope=s), ("leaky_relu",))
    if kind == "box":
        lo = draw(st.floats(-2, 2))
        return Malformed(kind, lambda: ce.get_activation("hardtanh", lo=lo, hi=lo), ("hardtanh",))
    if kind == "radius":
        return Malformed(kind, lambda: LinfBallIndicator(z, bad), (z.name,))
    if kind == "term_scale":
        t = L1(z)
        s = draw(st.sampled_from((math.nan, math.inf, "2")))
        return Malformed(kind, lambda: t * s, (z.name,))
    if kind == "scalar_unbounded":
        t = SqNorm(z)
        return Malformed(kind, lambda: t * Scalar("lam_u", 0.5), ("lam_u",))
    if kind == "scalar_range":
        return Malformed(kind, lambda: Scalar("lam_r", -1.0, low=0.0), ("lam_r",))
    if kind == "scalar_env":
        g = Scalar("gam_e", 0.5, low=0.0, low_open=True)
        q = Weight(b.name("q"), (n,))
        phi = Objective([GaussianKernel(q - z, g)])
        return Malformed(kind, lambda: phi.value(**{z.name: np.zeros(n), "gam_e": bad}),
                         ("gam_e",))
    if kind == "tau":
        phi = Objective([L1(z), SqNorm(Dense(Weight(b.name("W"), (n, n))) @ z)])
        tau = draw(st.sampled_from((0.0, -1.0, 1e9)))
        return Malformed(kind, lambda: lowering.lower(phi, tau=tau), ("τ",))
    if kind == "activation_unknown":
        return Malformed(kind, lambda: Potential("swishy", z), ("swishy",))
    if kind == "activation_params":
        return Malformed(kind, lambda: ce.get_activation("relu", slope=0.1), ("relu",))
    if kind == "sympy_invalid":
        src = draw(st.sampled_from(sorted(SYMPY_INVALID)))
        t = sp.Symbol("t")
        expr = sp.sympify(src, locals={"t": t})
        return Malformed(kind, lambda: ce.from_sympy(expr, t),
                         (str(expr),), (ce.ActivationError,))
    if kind == "sympy_extra_symbol":
        t, a = sp.Symbol("t"), sp.Symbol("a")
        return Malformed(kind, lambda: ce.from_sympy(a * t, t), ("a*t",), (ce.ActivationError,))

    # ---------------------------------------------------------------- unsupported compositions
    if kind == "moreau_two_block":
        z2 = State(b.name("z"), m)
        phi = Objective([L1(z), SqNorm(z2)])
        return Malformed(kind, lambda: moreau(phi, 0.5), ("M[",))
    if kind == "l1_gradient":
        phi, zz = _opteq_parts(b, n)
        obj = phi + L1(zz) * 0.1
        return Malformed(kind, lambda: lowering.lower(obj, regularizer="gradient"), ("||",))
    if kind == "two_prox_regs":
        phi, zz = _opteq_parts(b, n)
        obj = phi + L1(zz) * 0.1 + LinfBallIndicator(zz, 2.0)
        return Malformed(kind, lambda: lowering.lower(obj), ("||",))
    if kind == "prox_variant_smooth":
        phi, zz = _opteq_parts(b, n)
        obj = phi + FeatureIncay(zz) * 0.1
        return Malformed(kind, lambda: lowering.lower(obj, regularizer="prox"), ("2/(||",))
    if kind == "bad_variant":
        phi, zz = _opteq_parts(b, n)
        obj = phi + L1(zz) * 0.1
        return Malformed(kind, lambda: lowering.lower(obj, regularizer="sideways"),
                         ("sideways",))
    if kind == "precompose_declare":  # a Moreau envelope term has no affine argument to map
        phi, _ = _opteq_parts(b, n)
        env_obj = Objective([moreau(phi, 0.5)])
        return Malformed(kind, lambda: precompose(env_obj, np.eye(n)), ("M^",))
    if kind == "deep_nonprox_layer":
        layer = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(DeepComposition([layer], 0.5)),
                         ("Σ f_relu",))
    if kind == "deep_cor1_alpha1":
        p1, _ = _opteq_parts(b, n)
        p2, _ = _opteq_parts(b, n)
        return Malformed(kind, lambda: DeepComposition([p1, p2], 1.0, name="deepnet")
                         .corollary1_objective(), ("deepnet",))
    if kind == "moreau_negative":
        phi, _ = _opteq_parts(b, n)
        obj = Objective([moreau(phi, 0.5) * -0.5])
        return Malformed(kind, lambda: lowering.lower(obj), ("M^",))
    if kind == "two_nonsmooth":
        obj = Objective([L1(z), LinfBallIndicator(z, 2.0), SqNorm(z)])
        return Malformed(kind, lambda: lowering.lower(obj), ("||",))
    if kind == "nonsmooth_composed":
        w = Weight(b.name("W"), (m, n))
        obj = Objective([L1(w @ z), SqNorm(z)])
        return Malformed(kind, lambda: lowering.lower(obj), (w.name,))
    if kind == "unknown_option":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi, flavour=1), ("flavour",))
    if kind == "lower_garbage":
        return Malformed(kind, lambda: lowering.lower(42), ("int",))
    if kind == "negative_prox_term":
        w = Weight(b.name("W"), (n, n), 0.5 * np.eye(n))
        g = draw(st.sampled_from(("l1", "pot")))
        t = L1(z) * -1.0 if g == "l1" else Potential("relu", z) * -1.0
        obj = Objective([t, SqNorm(Dense(w) @ z)])

        def go() -> Any:
            d = lowering.lower(obj)
            return d.apply({z.name: torch.ones(2, n, dtype=torch.float64)})

        return Malformed(kind, go, (str(t),))
    if kind == "moreau_general_no_prox":
        phi, zz = _opteq_parts(b, n)
        obj = Objective([moreau(phi, 0.3) * 0.5])

        def go2() -> Any:
            d = lowering.lower(obj)
            return d.apply({zz.name: torch.ones(2, n, dtype=torch.float64),
                            "x": torch.ones(2, b.d, dtype=torch.float64)})

        return Malformed(kind, go2, ("ψ", "Σ ∫relu", "M^"))
    if kind == "hsic_batch1":
        zz = State(b.name("z"), 3)
        w = Weight(b.name("W"), (3, 3), 0.5 * np.eye(3))
        obj = Objective([Potential("relu", zz), SqNorm(zz), SqNorm(Dense(w) @ zz) * -1.0,
                         HSIC(zz) * 0.1])
        return Malformed(kind, lambda: lowering.lower(obj).apply(
            {zz.name: torch.ones(1, 3, dtype=torch.float64)}), ("HSIC",))
    if kind == "regularizer_other_state":
        phi, zz = _opteq_parts(b, n)
        z2 = State(b.name("z"), n)
        obj = phi + L1(z2) * 0.1
        return Malformed(kind, lambda: lowering.lower(obj), (zz.name, z2.name))
    return _malformed_api(kind, draw, b, z, n, m)


def _malformed_api(kind: str, draw: Any, b: Builder, z: State, n: int, m: int) -> Malformed:
    """Misuse of the constructors and helpers of the language (operators, symbols, models,
    options)."""
    from convex_eq.operators import AvgDownsample, BlockDiag, CyclicPermutation

    if kind == "empty_objective":
        return Malformed(kind, lambda: Objective([], name="emptyobj"), ("emptyobj",))
    if kind == "objective_garbage":
        return Malformed(kind, lambda: Objective([SqNorm(z), 42], name="garb"), ("garb", "int"))
    if kind == "matmul_size":
        w = Weight(b.name("W"), (m, m))
        return Malformed(kind, lambda: w @ z, (w.name,))
    if kind == "dense_3d":
        w = Weight(b.name("K"), (2, 2, 2))
        return Malformed(kind, lambda: Dense(w), (w.name,))
    if kind == "avgpool_factor":
        f = draw(st.sampled_from((0, -1, 3, 1.5)))
        return Malformed(kind, lambda: AvgDownsample(f, (1, 4, 4)), ("avgpool", "AvgDownsample"))
    if kind == "conv_stride":
        w = Weight(b.name("K"), (1, 1, 3, 3))
        return Malformed(kind, lambda: Conv2d(w, in_shape=(1, 4, 4), stride=0), ("stride",))
    if kind == "conv_kernel_big":
        w = Weight(b.name("K"), (1, 1, 5, 5))
        return Malformed(kind, lambda: Conv2d(w, in_shape=(1, 2, 2)), (w.name,))
    if kind == "empty_blocks":
        mk = draw(st.sampled_from((lambda: BlockDiag([]), lambda: CyclicPermutation([]))))
        return Malformed(kind, mk, ("blkdiag", "P_cyc"))
    if kind == "bad_symbol_name":
        name = draw(st.sampled_from(("1z", "z-1", "", "a b")))
        return Malformed(kind, lambda: State(name, 2), (repr(name),))
    if kind == "symbol_value_shape":
        return Malformed(kind, lambda: Weight("Wv", (n, n), np.zeros((n, m))), ("Wv",))
    if kind == "scalar_nan":
        v = draw(st.sampled_from((math.nan, math.inf)))
        return Malformed(kind, lambda: Scalar("sc_n", v, low=0.0), ("sc_n",))
    if kind == "linear_state_coef":
        return Malformed(kind, lambda: Linear(z, z), (z.name,))
    if kind == "conjugate_no_rule":
        t = draw(st.sampled_from(("gauss", "incay", "coupling", "neg_l1", "decor")))
        q = Weight(b.name("q"), (n,))
        term = {"gauss": lambda: GaussianKernel(q - z), "incay": lambda: FeatureIncay(z),
                "coupling": lambda: Coupling(z, z), "neg_l1": lambda: L1(z) * -1.0,
                "decor": lambda: BatchDecorrelation(State(b.name("z"), 3))}[t]()
        return Malformed(kind, lambda: ce.conjugate(term), (str(term),))
    if kind == "conjugate_affine_no_op":
        q = Weight(b.name("q"), (n,))
        term = Antiderivative("relu", z + q)
        return Malformed(kind, lambda: ce.conjugate(term), (str(term),))
    if kind == "model_options":
        mk = draw(st.sampled_from((
            lambda: models.opteq(form="sideways"),
            lambda: models.mopteq(shapes=((2, 4, 4),)),
            lambda: models.opteq(conv=(2, 3)),
            lambda: models.geq(patch=2, image=(1, 3, 3), p=16),
        )))
        return Malformed(kind, mk, ("opteq", "mopteq", "geq"))
    if kind == "sam_config":
        cfg = draw(st.sampled_from(({"rho": 1.0}, {"c": -0.1}, {"R": L1(z)})))
        from lowering import SAMConfig

        return Malformed(kind, lambda: SAMConfig(**{"R": SqNorm(z), **cfg}), ("SAM",))
    if kind == "register_duplicate":
        return Malformed(kind, lambda: ce.register_activation("relu", lambda: None), ("relu",))
    if kind == "activation_type":
        return Malformed(kind, lambda: ce.get_activation(42), ("42",))
    if kind == "from_sympy_check":
        t = sp.Symbol("t")
        return Malformed(kind, lambda: ce.from_sympy(t / 2, t, check="bogus"), ("bogus",))
    if kind == "objective_symbol":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.symbol("nope"), ("nope",))
    if kind == "certificate_kwargs":
        phi = _canon(b, z)
        return Malformed(kind, lambda: phi.certificate(**{z.name: np.zeros(n)}), (z.name,))
    if kind == "precompose_two_states":
        z2 = State(b.name("z"), n)
        phi = Objective([SqNorm(z), SqNorm(z2)])
        return Malformed(kind, lambda: precompose(phi, np.eye(n)), ("precompose", z.name))
    if kind == "deep_empty":
        return Malformed(kind, lambda: DeepComposition([], 0.5, name="deepnet"), ("deepnet",))
    if kind == "deep_same_state":
        p1, zz = _opteq_parts(b, n)
        return Malformed(kind, lambda: DeepComposition([p1, p1], 0.5, name="deepnet"),
                         ("deepnet",))
    if kind == "coupling_P_type":
        return Malformed(kind, lambda: Coupling(z, z, "P"), ("Coupling",))
    if kind == "patch_no_layout":
        zz = State(b.name("z"), 4)
        wh = Weight(b.name("Wh"), (4, 2))
        return Malformed(kind, lambda: PatchGaussianKernel(zz, zz, 1.0, 2, wh), ("Patch",))
    if kind == "hardtanh_nan":
        return Malformed(kind, lambda: ce.get_activation("clamp", lo=math.nan, hi=1.0),
                         ("clamp",))
    if kind == "T_unknown_name":
        phi = _canon(b, z)
        return Malformed(kind, lambda: lowering.lower(phi).T(**{z.name: np.zeros(n),
                                                                "bogus": 1}), ("bogus",))
    if kind == "prox_negative_step":
        t = L1(z)
        return Malformed(kind, lambda: t.prox(torch.zeros(1, n), -1.0), (z.name,))
    if kind == "solve_options":
        f = draw(st.sampled_from(({"solver": "magic"}, {"solver": "plain", "damping": 0.0},
                                  {"solver": "anderson", "m": 0})))
        return Malformed(kind, lambda: lowering.solve(lambda v: v, torch.zeros(1, 2), **f),
                         ("solver",))
    raise AssertionError(f"unhandled malformed kind {kind}")


MALFORMED_KINDS = (
    "linear_size", "gram_size", "affine_sum", "gauss_size", "coupling_P", "coupling_noP",
    "chandecor_channels", "patch_divide", "patch_wh", "quadform_shape", "quadform_asym",
    "precompose_shape", "precompose_singular", "deep_sizes", "duplicate_names",
    "bad_symbol_shape", "nonfinite_weight", "scalar_as_vector", "no_state", "conv_channels",
    "downsample_channels", "value_shape", "value_batch", "value_unknown", "value_weight_shape",
    "T_shape", "T_batch", "T_missing", "export_missing_input", "export_state", "export_batch",
    "module_input_shape", "module_input_nan", "module_z0_shape", "module_batch",
    "module_options", "moreau_mu", "moreau_mu_env", "gamma", "patch_gamma", "incay_eps",
    "hsic_sigma", "deep_alpha", "slope", "box", "radius", "term_scale", "scalar_unbounded",
    "scalar_range", "scalar_env", "tau", "activation_unknown", "activation_params",
    "sympy_invalid", "sympy_extra_symbol", "moreau_two_block", "l1_gradient", "two_prox_regs",
    "prox_variant_smooth", "bad_variant", "precompose_declare", "deep_nonprox_layer",
    "deep_cor1_alpha1", "moreau_negative", "two_nonsmooth", "nonsmooth_composed",
    "unknown_option", "lower_garbage", "negative_prox_term", "moreau_general_no_prox",
    "hsic_batch1", "regularizer_other_state",
    # misuse of constructors / helpers
    "empty_objective", "objective_garbage", "matmul_size", "dense_3d", "avgpool_factor",
    "conv_stride", "conv_kernel_big", "empty_blocks", "bad_symbol_name", "symbol_value_shape",
    "scalar_nan", "linear_state_coef", "conjugate_no_rule", "conjugate_affine_no_op",
    "model_options", "sam_config", "register_duplicate", "activation_type", "from_sympy_check",
    "objective_symbol", "certificate_kwargs", "precompose_two_states", "deep_empty",
    "deep_same_state", "coupling_P_type", "patch_no_layout", "hardtanh_nan", "T_unknown_name",
    "prox_negative_step", "solve_options",
)


@st.composite
def malformed(draw: Any, kinds: tuple[str, ...] | None = None) -> Malformed:
    """A malformed case (see the module docstring); ``kinds`` restricts the menu."""
    b = Builder(draw, draw(st.integers(0, 2**31 - 1)))
    if kinds is not None:
        sub = draw(st.sampled_from(kinds))
        return _malformed_cases(_Fixed(draw, sub), b)
    return _malformed_cases(draw, b)


class _Fixed:
    """A ``draw`` whose first call returns a fixed kind (used to restrict the menu)."""

    def __init__(self, draw: Any, kind: str):
        self.draw, self.kind, self.used = draw, kind, False

    def __call__(self, strategy: Any) -> Any:
        if not self.used:
            self.used = True
            return self.kind
        return self.draw(strategy)


# ----------------------------------------------------------------------------- prox-able φ
@st.composite
def proxable_objectives(draw: Any) -> tuple[Objective, float, float]:
    """``(φ, t, v)``: a 1-D objective with a closed-form prox (one prox-able term — potential,
    its conjugate, σ̃*, ℓ1, ℓ∞ ball, envelope — plus ``a/2 z²`` with ``1 + t·a > 0`` and a
    linear term), a step ``t`` and a point ``v``: ``Objective.prox`` is what the Moreau rules
    and the regularizer edits evaluate."""
    b = Builder(draw, draw(st.integers(0, 2**31 - 1)))
    z = State(b.name("z"), 1)
    kind = draw(st.sampled_from(("pot", "aconj", "pconj", "l1", "linf", "moreau")))
    c = b.pos(0.2, 3.0)
    g = {"pot": lambda: Potential(b.activation(), z) * c,
         "aconj": lambda: AntiderivativeConjugate(b.activation(), z) * c,
         "pconj": lambda: Potential(b.activation(), z).conjugate() * c,
         "l1": lambda: L1(z) * c,
         "linf": lambda: LinfBallIndicator(z, c),
         "moreau": lambda: moreau(Objective([L1(z) * c]), b.pos(0.2, 2.0))}[kind]()
    t = draw(st.sampled_from((0.3, 1.0, 2.5)) | st.floats(0.05, 5.0))
    terms: list[Any] = [g]
    a = draw(st.sampled_from((0.0, 0.5, -0.3)))
    if a and 1 + t * a > 0:
        terms.append(SqNorm(z) * a)
    if draw(st.booleans()):
        terms.append(Linear(Weight(b.name("w"), (1,), [draw(st.floats(-2, 2))]), z))
    v = draw(st.floats(-4.0, 4.0))
    return Objective(terms, name="phi"), t, v
