"""Cheap switches of torch's gradient mode for the per-call path."""

from __future__ import annotations

import torch

#: ``torch.set_grad_enabled`` without its context-manager machinery
set_grad_enabled = torch._C._set_grad_enabled


class grad_off:  # lower case: used like torch.no_grad
    """``torch.no_grad()`` for the per-call path: gradients off inside, switched only when they
    are on (a first-order backward already runs without them).  Two Python calls against the
    about eight of ``torch.no_grad()`` (a decorator class); the module enters such a region
    several times a call."""

    __slots__ = ("on",)

    def __enter__(self) -> None:
        self.on = torch.is_grad_enabled()
        if self.on:
            set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        if self.on:
            set_grad_enabled(True)
