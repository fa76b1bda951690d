"""Lowering rules: one small unit per rule, each with the condition it needs."""
