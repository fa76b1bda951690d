"""``convex-eq bench``: the emitted module against cvxpylayers, a hand-written loop and torchdeq."""
