"""Which reference verifies a claim (docs/theory.md §9), as code: one unit per reference kind in
``verify/references/`` behind one small protocol, registered in ``REFERENCE_KINDS`` in the order
of this table; ``select_reference`` picks the first that applies::

    | situation                                            | reference                             |
    |------------------------------------------------------|---------------------------------------|
    | no equilibrium found                                 | none (nothing to compare)             |
    | deep composition                                     | deep (Corollary 1 / Theorem 2)        |
    | SAM module                                           | sam (Tikhonov path of argmin_Fix T R) |
    | not an objective                                     | unavailable (the check fails)         |
    | fixed point of an iteration (state-dependent γ)      | iteration (residual, frozen γ)        |
    | non-convex claim, certificate violated, or ``local`` | local (never "minimizer")             |
    | convex claim, certified, ``numeric``                 | numeric                               |
    | convex claim, certified, ``auto``/``cvxpy``          | cvxpy (numeric if not DCP, ``auto``)  |
"""

from __future__ import annotations

from dataclasses import replace

from convex_eq.errors import OptionError

from .references.absent import NoReference, Unavailable
from .references.base import Reference, Situation
from .references.cvxpy import CvxpyReference
from .references.deep import DeepReference
from .references.local import IterationReference, LocalReference
from .references.numeric import NumericReference
from .references.sam import SamReference

__all__ = ["REFERENCE_KINDS", "REQUESTS", "Reference", "Situation", "refuse_inapplicable",
           "select_reference"]

#: what ``verify.check(..., reference=...)`` accepts
REQUESTS = ("auto", "cvxpy", "numeric", "local")

#: reference kind → implementation, in the order of the table (the first that applies is used)
REFERENCE_KINDS: dict[str, Reference] = {r.kind: r for r in (
    NoReference(), DeepReference(), SamReference(), Unavailable(), IterationReference(),
    LocalReference(), NumericReference(), CvxpyReference())}


def select_reference(s: Situation) -> str:
    """The reference kind for situation ``s`` (the table in the module docstring)."""
    return next(kind for kind, ref in REFERENCE_KINDS.items() if ref.applies(s))


def refuse_inapplicable(s: Situation) -> None:
    """Refuse a ``reference=`` request that cannot verify this claim whatever the weights, with
    the requests that can (``OptionError``).  A convex claim whose certificate fails at the
    current weights is not refused: the check reports the violated condition instead."""
    if s.requested == "auto":
        return
    static = replace(s, certified=True, equilibrium_found=True)
    ref = REFERENCE_KINDS[select_reference(static)]
    if ref.answers(s.requested, static):
        return
    usable = [r for r in REQUESTS if _answered(replace(static, requested=r))]
    raise OptionError(f"reference={s.requested!r} does not apply to this layer: "
                      f"{ref.scope(static)}", term="verify.check",
                      hint="use reference=" + " or ".join(repr(r) for r in usable))


def _answered(s: Situation) -> bool:
    """Whether the request of ``s`` reaches a reference that answers it."""
    return REFERENCE_KINDS[select_reference(s)].answers(s.requested, s)
