"""The limit: a minimal hand-written torch DEQ for ``z = relu(Wᵀ(Wz) + q)``.

The emitted module's Anderson path written by hand: Anderson type II with history 5, stopping
when every sample's relative residual ``||f(z) − z|| / ||f(z)||`` is ≤ tol, output ``f`` of the
last iterate, and the implicit backward as a tensor hook solving ``g = Jᵀg + ∂ℓ/∂z`` with the
same Anderson (VJPs by autograd).  Its small problem differs in form, not in size: the Gram
matrix in the state's dtype (the module's in float64), the ridge ``lam·tr(GGᵀ)/k + sqrt(tiny)``
on every diagonal entry (the module's ``lam·||g_i||² + sqrt(tiny)`` per entry; ``lam = 1e-8``
both) and the bordered system (the module normalises ``A⁻¹1``).
What it leaves out is the toolkit: no expression tree, no per-iteration bookkeeping of the best
iterate, no NaN checks, no statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def anderson(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, tol: float,
             max_iter: int, m: int = 5, lam: float = 1e-8) -> tuple[torch.Tensor, int]:
    """Anderson acceleration; returns ``(f(z_last), number of f evaluations)``."""
    b, n = z0.shape
    X = z0.new_zeros(b, m, n)
    F = z0.new_zeros(b, m, n)
    X[:, 0] = z0
    F[:, 0] = f(z0)
    if done(F[:, 0], X[:, 0], tol):
        return F[:, 0], 1
    X[:, 1] = F[:, 0]
    F[:, 1] = f(F[:, 0])
    if done(F[:, 1], X[:, 1], tol):
        return F[:, 1], 2
    H = z0.new_zeros(b, m + 1, m + 1)
    H[:, 0, 1:] = 1
    H[:, 1:, 0] = 1
    y = z0.new_zeros(b, m + 1, 1)
    y[:, 0] = 1
    eye = torch.eye(m, dtype=z0.dtype, device=z0.device)
    tiny = torch.finfo(z0.dtype).tiny ** 0.5
    fx = F[:, 1]
    for k in range(2, max_iter):
        nk = min(k, m)
        G = F[:, :nk] - X[:, :nk]
        GG = G @ G.transpose(1, 2)
        ridge = lam * GG.diagonal(dim1=1, dim2=2).mean(dim=1) + tiny
        H[:, 1:nk + 1, 1:nk + 1] = GG + ridge[:, None, None] * eye[:nk, :nk]
        alpha = torch.linalg.solve(H[:, :nk + 1, :nk + 1], y[:, :nk + 1])[:, 1:, 0]
        x = (alpha[:, None] @ F[:, :nk])[:, 0]
        fx = f(x)
        X[:, k % m] = x
        F[:, k % m] = fx
        if done(fx, x, tol):
            return fx, k + 1
    return fx, max_iter


def done(fz: torch.Tensor, z: torch.Tensor, tol: float) -> bool:
    """Every sample's ``||fz − z|| ≤ tol·max(||fz||, 1e-30)``, in the fastest form of this test we
    measured: the worst residual read as a Python float and compared in Python (``bool(r.max()
    <= tol)`` costs a scalar tensor and one more operation: 7–14 % of a fwd+bwd call of the
    limit case, m = 64, B = 32–256; it also rounds ``tol`` to the state's dtype, where the
    emitted module's stop test compares Python floats, as this one does), the division and the
    floor in place on the fresh norms (2–4 % more).  The floor keeps a sample whose fixed point
    is 0 from reading 0/0 = NaN, never "done"."""
    norm = torch.linalg.vector_norm
    r = norm(fz - z, dim=1).div_(norm(fz, dim=1).clamp_min_(1e-30))
    return float(r.max()) <= tol


class HandDEQ(torch.nn.Module):
    """``q ↦ z*`` with Anderson forward and implicit (IFT) backward through a hook."""

    def __init__(self, w: torch.Tensor, tol: float = 1e-6, max_iter: int = 100):
        super().__init__()
        self.W = torch.nn.Parameter(w.detach().clone())
        self.tol, self.max_iter = tol, max_iter
        self.last_iterations = 0
        self.last_backward_iterations = 0

    def f(self, z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The layer ``relu(Wᵀ(Wz) + q)`` (same operation order as the emitted module)."""
        return torch.relu(q + (z @ self.W.T) @ self.W)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z_star, self.last_iterations = anderson(lambda z: self.f(z, q), torch.zeros_like(q),
                                                    self.tol, self.max_iter)
        if not torch.is_grad_enabled():
            return z_star
        z = self.f(z_star, q)
        z0 = z_star.clone().requires_grad_()
        f0 = self.f(z0, q)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            def adj(v: torch.Tensor) -> torch.Tensor:
                return torch.autograd.grad(f0, z0, v, retain_graph=True)[0] + grad

            with torch.no_grad():
                g, self.last_backward_iterations = anderson(adj, grad, self.tol, self.max_iter)
            return g

        z.register_hook(hook)
        return z
