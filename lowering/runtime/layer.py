"""What the runtime's units read of an emitted module (:class:`Layer`): the module
(:class:`~lowering.runtime.module.EquilibriumModule`) satisfies it, and the units that serve it
(inputs, parameters, calls, failures, warm starts) type their argument by it, so that none of
them imports the module itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from lowering.derived import DerivedLayer


class Layer(Protocol):
    """The members of an emitted module its runtime units read (docs/guide.md)."""

    config: Any
    derived: DerivedLayer
    blocks: list[Any]
    input_syms: list[Any]
    weights: nn.ParameterDict
    scalar_params: nn.ParameterDict
    weight_control: Any
    warm_start_cache: Any
    training: bool
    _batch_coupled: bool
    _shapes: dict[str, tuple[int, ...]]
    _const_names: list[str]
    _scalar_names: list[str]
    _scalar_maps: dict[str, Any]
    _checksums: Any
    _fingerprint: str
    _plannable: bool
    _buffers: dict[str, torch.Tensor | None]

    @property
    def state_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def tol(self) -> float: ...

    @property
    def max_iter(self) -> int: ...

    @property
    def solver(self) -> str: ...

    @property
    def backward(self) -> str: ...

    @property
    def on_nonconvergence(self) -> str: ...

    @property
    def sam(self) -> Any: ...

    def env(self) -> dict[str, torch.Tensor]: ...

    def T(self, z: torch.Tensor, inputs: dict[str, torch.Tensor],
          env: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def trained_names(self) -> list[str]: ...

    def shape_out(self, z: torch.Tensor) -> Any: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None,
                        persistent: bool = True) -> None: ...

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...
