"""Linear operators on flat batched tensors: ``apply(v)``: ``(B, in) -> (B, out)``, ``adjoint``.

One module per operator; all share the :class:`LinOp` interface (``apply``, ``adjoint``,
``matrix``, ``norm``, ``symbols``, ``latex``, ``T``, ``@``).
"""

from .adjoint import Adjoint
from .base import LinOp
from .blockdiag import BlockDiag
from .compose import Compose
from .conv import Conv1d, Conv2d
from .convert import as_operator
from .dense import Dense
from .identity import Identity
from .inverse import Inverse
from .permutation import CyclicPermutation
from .pooling import AvgDownsample, Upsample, downsample_or_identity

__all__ = [
    "Adjoint",
    "AvgDownsample",
    "BlockDiag",
    "Compose",
    "Conv1d",
    "Conv2d",
    "CyclicPermutation",
    "Dense",
    "Identity",
    "Inverse",
    "LinOp",
    "Upsample",
    "as_operator",
    "downsample_or_identity",
]
