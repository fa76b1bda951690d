"""``python -m convex_eq_app`` = the ``convex-eq`` command."""

import sys

from .cli import main

sys.exit(main())
