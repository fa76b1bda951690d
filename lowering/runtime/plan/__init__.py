"""Evaluation plans of ``T`` (docs/theory.md §8): the plan types (:mod:`.plans`), their
transpose Jacobians (:mod:`.transpose`) and the node-type → planner table (:mod:`.planners`)."""

from .planners import (
    AFFINE_BUILDERS,
    HELD_BUILDERS,
    PLANNERS,
    affine_builder_of,
    held_builder_of,
    plan_of,
    register_planner,
)
from .plans import AffineElementwise, Plan, PlanContext, Root

__all__ = ["AFFINE_BUILDERS", "HELD_BUILDERS", "PLANNERS", "AffineElementwise", "Plan",
           "PlanContext", "Root", "affine_builder_of", "held_builder_of", "plan_of",
           "register_planner"]
