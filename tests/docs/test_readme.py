"""The README's code example runs as written and prints what the README says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_quickstart_runs_and_prints_what_the_readme_shows() -> None:
    """The quickstart's blocks run in order in one session: declare → derive → torch_module →
    train → verify; each block stays short enough to read, and the first prints exactly the
    certificate and derivation the README shows."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    assert sum(len(b.strip().splitlines()) for b in blocks) <= 26
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, code in enumerate(blocks):
            assert len(code.strip().splitlines()) <= 15
            exec(compile(code, f"README.md block {i + 1}", "exec"), namespace)
    printed = out.getvalue()
    shown = re.findall(r"prints the certificate and the derivation:\n\n```text\n(.*?)```", text,
                       re.S)
    assert len(shown) == 1 and printed.startswith(shown[0])
    # the trained module's equilibrium is the CVXPY minimizer (the claim of Theorem 1)
    assert namespace["report"].passed and namespace["report"].label == "minimizer"
    assert printed.rstrip().endswith("True minimizer")


def test_readme_has_the_two_commands_at_the_top() -> None:
    head = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(head) == 2
    assert head[0].endswith("convex-eq demo") and head[1].endswith("python -m pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    assert head[1] in ci  # .ci/run runs exactly the README test command
