"""Formatting shared by the benchmarks: durations and markdown tables."""

from __future__ import annotations


def fmt_t(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    """A markdown table with the columns in ``right`` right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return (
            "| "
            + " | ".join(
                c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
            )
            + " |"
        )

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def machine() -> str:
    """CPU and load average: timings on a busy machine are not comparable with an idle one's."""
    import os
    import platform

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"{platform.machine()} {os.cpu_count()} CPUs ({platform.processor() or platform.system()}), load average {load}"
    )


def sigprop_state(root) -> str:
    """Which sigprop was measured: the git commit, uncommitted engine/schema changes, or another copy."""
    import subprocess
    from pathlib import Path

    import sigprop

    try:
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "service", "schemas"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
        changed = [c[3:] for c in changed if c.strip()]
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        changed, head = [], "?"
    src = Path(sigprop.__file__).parent
    if src.resolve() != (Path(root) / "service").resolve():
        return f"sigprop imported from {src}"
    return f"sigprop git {head}" + (f" + uncommitted changes in {', '.join(changed)}" if changed else " (clean)")
