"""Where a report's numbers come from: date, commit, package versions, machine and command.

Every report the command line writes (``demo``, ``train-table``, ``reproduce``, ``verify
--markdown``) starts with :func:`header_lines` of a :func:`collect` record, and its JSON carries
the record under ``"provenance"`` (``convex-eq results`` heads each table of docs/results.md with
it).  Only the standard library is imported here; versions are read from the installed
distributions' metadata, so nothing heavy is imported to describe it.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

#: the source checkout (a git work tree when installed editable)
ROOT = Path(__file__).resolve().parents[1]

#: distributions whose versions a report names (absent ones are left out)
PACKAGES = ("convex-eq", "torch", "numpy", "cvxpy", "scipy", "sympy", "cvxpylayers", "mnist1d")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: ``convex-eq`` and its arguments, quoted for a shell."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["convex-eq", *args])


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit() -> dict[str, Any]:
    """``{"commit": full hash or None, "dirty": uncommitted changes to tracked files}`` of the
    source checkout (None outside a git work tree, e.g. a wheel install)."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(status)}


def versions() -> dict[str, str]:
    """Python and the installed versions of :data:`PACKAGES`."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str = "cpu") -> dict[str, Any]:
    """CPU model and count, operating system, the device the run used (a GPU's name when it is
    CUDA and torch is already loaded) and the 1-minute load average at the start."""
    info: dict[str, Any] = {"cpu": _cpu_model(), "cpus": os.cpu_count(),
                            "os": platform.platform(terse=True), "device": device}
    torch = sys.modules.get("torch")
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        info["load_1min"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def collect(argv: Sequence[str] | None = None, device: str = "cpu") -> dict[str, Any]:
    """The provenance record of a run started now by ``argv`` (default: this process's)."""
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **commit(), "versions": versions(), "machine": machine(device),
            "command": command_line(argv)}


def describe_machine(m: dict[str, Any]) -> str:
    """One line: ``<cpu> (<n> CPUs), <os>, device <dev> [<gpu>], load <l> at the start``."""
    text = f"{m.get('cpu', '?')} ({m.get('cpus', '?')} CPUs), {m.get('os', '?')}, " \
           f"device {m.get('device', '?')}"
    if m.get("gpu"):
        text += f" ({m['gpu']})"
    if m.get("load_1min") is not None:
        text += f", 1-minute load average {m['load_1min']:g} at the start"
    return text


def header_lines(prov: dict[str, Any], smoke: bool = False) -> list[str]:
    """Markdown lines stating the record (a bullet list), preceded by a warning for a smoke run
    (``--quick``), whose numbers are not results."""
    rev = prov.get("commit") or "unknown (not run from a git checkout)"
    if prov.get("dirty"):
        rev += " with uncommitted changes"
    vers = ", ".join(f"{k} {v}" for k, v in prov.get("versions", {}).items())
    lines = []
    if smoke:
        lines += ["> **Smoke run (`--quick`).** Tiny models, one epoch, a few hundred signals: "
                  "it checks that every step runs. Its numbers are not results and must not "
                  "be compared with published ones.", ""]
    lines += [f"- date: {prov.get('date', '?')}", f"- commit: {rev}", f"- versions: {vers}",
              f"- machine: {describe_machine(prov.get('machine', {}))}",
              f"- command: `{prov.get('command', '?')}`", ""]
    return lines


def column_lines(columns: dict[str, str]) -> list[str]:
    """Markdown lines defining each column of the table below or above them."""
    return ["Columns:", "", *[f"- **{name}**: {meaning}" for name, meaning in columns.items()],
            ""]
