"""The application layer of convex-eq: the ``convex-eq`` command line, the demo and the tour.

It sits on top of the libraries (``convex_eq`` declares, ``lowering`` derives, ``verify``
checks) and nothing below imports it.  ``convex_eq_app.cli`` imports only the standard library
at start-up, so ``convex-eq --help`` answers without loading torch, cvxpy or sympy.
"""
