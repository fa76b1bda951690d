"""The README's code example runs as written and prints what the README says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_is_short() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = blocks[0]
    assert len(code.strip().splitlines()) <= 15
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    text = out.getvalue()
    assert "convex if ||W||₂ ≤ 1 (now 0.9)" in text
    assert "optimal" in text


def test_readme_has_the_two_commands_at_the_top() -> None:
    head = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(head) == 2
    assert head[0].endswith("convex-eq demo") and head[1].endswith("python -m pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    assert head[1] in ci  # .ci/run runs exactly the README test command
