"""Shared pytest configuration: hypothesis profiles and numeric defaults.

Profiles: ``ci`` (fast, used when CI=true), ``dev`` (default locally) and ``thorough``
(``HYPOTHESIS_PROFILE=thorough python -m pytest``)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=15, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))

# tiny tensors: one intra-op thread avoids OpenMP spin/hand-off costs (dominant on a busy machine)
torch.set_num_threads(1)
