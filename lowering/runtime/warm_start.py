"""Warm starts from a per-sample cache of equilibria (docs/guide.md, training speed).

Where the layer's equilibrium is unique, any starting point converges to the same point, so
starting each sample's solve from its equilibrium of the last time it was seen (the previous
epoch, in training) changes the cost of the solve and not its answer.  The cache holds one flat
state per sample index of the dataset (``sample_ids``, given with each batch), ``size × N``
entries of the module's dtype.
"""

from __future__ import annotations

import torch

from convex_eq.errors import OptionError, ShapeError

from .layer import Layer
from .weight_control import certificate_conditions, kept_by


def refuse_without_uniqueness(m: Layer) -> None:
    """A typed error unless the certificate makes the equilibrium unique for every weight
    training can reach: a convexity (or monotonicity) certificate, ``T`` a contraction at the
    weights now (``Lip(T) < 1``), and every condition of the certificate kept during training
    (by weight control, or reading no trained tensor)."""
    d = m.derived
    cert = d.certificate
    why = None
    if cert is None or getattr(cert, "kind", None) == "nonconvex":
        why = ("its objective is not certified convex (the claim is a stationary point: "
               "several equilibria can exist, and where a solve starts decides which it finds)")
    else:
        trained = m.trained_names()
        loose = [c.text for c in certificate_conditions(d)
                 if kept_by(c, m.weight_control, trained) == "not kept"]
        if loose:
            why = (f"the certificate's condition(s) {'; '.join(loose)} are not kept during "
                   "training, so uniqueness may be lost as the weights move")
        else:
            with torch.no_grad():
                env = {k: v.detach() for k, v in m.env().items()}
                lip = d.contraction.value(env)
            if not lip < 1:
                why = f"T is not a certified contraction here ({d.contraction.describe(env, lip)})"
    if why is not None:
        raise OptionError(f"warm_start needs a layer whose equilibrium is unique; here {why}",
                          term="torch_module",
                          hint="train without warm_start (warm_start=0), or keep the "
                          "certificate's conditions with weight control")


class WarmStartCache:
    """One flat state per sample index: the last equilibrium found for that sample (``have``:
    which indices hold one).  Made on first use in the module's dtype and device, again when
    they change; emptied when the module's derivation or state size differs."""

    def __init__(self, size: int, state_size: int):
        self.size, self.n = int(size), int(state_size)
        self.z: torch.Tensor | None = None
        self.have: torch.Tensor | None = None
        #: samples started from the cache / from zero, summed over calls
        self.hits, self.misses = 0, 0

    @property
    def nbytes(self) -> int:
        """Memory the cache holds (0 before its first use)."""
        return 0 if self.z is None else self.z.numel() * self.z.element_size()

    def _ready(self, like: torch.Tensor) -> None:
        if self.z is None or self.z.dtype != like.dtype or self.z.device != like.device:
            self.z = torch.zeros(self.size, self.n, dtype=like.dtype, device=like.device)
            self.have = torch.zeros(self.size, dtype=torch.bool, device=like.device)

    def clear(self) -> None:
        """Forget every stored equilibrium (e.g. after the weights were replaced)."""
        self.z = self.have = None

    def check_ids(self, ids: torch.Tensor, batch: int) -> torch.Tensor:
        """``ids`` as a long tensor of ``batch`` indices in ``[0, size)`` (typed error else)."""
        if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.shape[0] != batch \
                or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ShapeError(f"sample_ids must be an integer tensor of shape ({batch},), one "
                             "dataset index per sample", term="forward",
                             hint="pass the indices your Dataset returns with each sample")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.size):
            raise ShapeError(f"sample_ids must lie in [0, {self.size}) (warm_start={self.size}); "
                             f"got [{int(ids.min())}, {int(ids.max())}]", term="forward",
                             hint="build the module with warm_start=len(dataset)")
        return ids.long()

    def start(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The start ``(B, N)``: each sample's stored equilibrium, zero where none is."""
        self._ready(like)
        assert self.z is not None and self.have is not None
        ids = ids.to(self.z.device)
        hit = self.have[ids]
        z0 = torch.where(hit[:, None], self.z[ids], torch.zeros((), dtype=like.dtype,
                                                               device=like.device))
        nh = int(hit.sum())
        self.hits += nh
        self.misses += ids.numel() - nh
        return z0

    def store(self, ids: torch.Tensor, z: torch.Tensor, ok: torch.Tensor | None) -> None:
        """Keep the solved states ``z`` of samples ``ids`` (only those ``ok``: converged)."""
        self._ready(z)
        assert self.z is not None and self.have is not None
        ids = ids.to(self.z.device)
        z = z.detach()
        if ok is not None:
            ids, z = ids[ok], z[ok]
        self.z[ids] = z
        self.have[ids] = True
