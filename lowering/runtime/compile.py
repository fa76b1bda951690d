"""``compile_disabled``: ``torch.compiler.disable`` without importing ``torch._dynamo`` early."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def compile_disabled(fn: F) -> F:
    """``torch.compiler.disable(fn)``, built the first time ``fn`` runs with dynamo loaded.

    Decorating with ``torch.compiler.disable`` at definition imports ``torch._dynamo`` (and with it
    sympy, ~1 s) when ``lowering`` is imported.  ``torch.compile`` imports dynamo before it traces
    anything, so until then no compiled caller can exist and ``fn`` runs as is; afterwards every
    call goes through the disabled wrapper (same graph breaks as the decorator at definition).
    A call made inside another such function's disabled region runs ``fn`` directly: dynamo is
    off there already, and the wrapper's own cost (it switches the frame callback off and on)
    was paid once by the outer call.
    """
    disabled: Callable[..., Any] | None = None

    def inside(*args: Any, **kwargs: Any) -> Any:  # runs in the disabled region
        prev = getattr(_STATE, "inside", False)
        _STATE.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.inside = prev

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        # (not while dynamo traces this call: a torch.compile-d function entered inside the
        # region re-enables dynamo for its own frames, and fn must stay a graph break there)
        if getattr(_STATE, "inside", False) and not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(inside)
            call.disabled = disabled  # type: ignore[attr-defined]
        return disabled(*args, **kwargs)

    #: the ``torch.compiler.disable`` wrapper once made (None before): code that dynamo traces
    #: calls it directly, a graph break of its own frame, instead of tracing into ``call``
    #: (whose break inside an inlined frame costs a resume function per call)
    call.disabled = None  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


#: per thread: whether the running code is inside a ``compile_disabled`` function's region
_STATE = threading.local()
