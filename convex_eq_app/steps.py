"""Named steps of a command: a failure says which step failed, ``-v`` logs each step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("convex_eq_app")


class StepFailed(Exception):
    """A library error (``ConvexEqError``) raised inside the named step of a command."""

    def __init__(self, step: str, error: Exception):
        self.step = step
        self.error = error
        super().__init__(f"failed at step '{step}': {error}")


@contextmanager
def step(name: str) -> Iterator[None]:
    """Run the body as step ``name``: log its start and duration; wrap a ``ConvexEqError``."""
    from convex_eq.errors import ConvexEqError

    log.info("step '%s' ...", name)
    t0 = time.perf_counter()
    try:
        yield
    except ConvexEqError as err:
        raise StepFailed(name, err) from err
    log.info("step '%s' done (%.2f s)", name, time.perf_counter() - t0)
