"""python -m sched: every registered scheduling mechanism as a table of kind, name, file and paper section, and
which presets (configs/sched/*.toml) use it. Run it from the repository root: elsewhere `python -m sched` finds the
standard library's `sched` module, which prints nothing (no file here can change that)."""
from __future__ import annotations

import sys
from pathlib import Path

from sched import PRESET_DIR, preset_tables
from sched.base import REGISTRY


def rows() -> list[tuple[str, str, str, str, str]]:
    import sched.policies  # noqa: F401  (registers the built-in mechanisms)
    root = Path(__file__).resolve().parent.parent
    used: dict[tuple[str, str], list[str]] = {}
    for f in sorted(PRESET_DIR.glob("*.toml")):
        for kind, table in preset_tables(f.stem).items():
            used.setdefault((kind, table.get("name", "")), []).append(f.stem)
            if "admit" in table:   # a round-composing dispatch delegates placement to another dispatch
                used.setdefault((kind, table["admit"]), []).append(f.stem)
    out = []
    for kind, names in REGISTRY.items():
        for name, cls in sorted(names.items()):
            path = Path(sys.modules[cls.__module__].__file__ or "").resolve().relative_to(root)
            out.append((kind, name, str(path), cls.paper, ", ".join(sorted(set(used.get((kind, name), []))))))
    return out


USAGE = """usage: python -m sched      (from the repository root)

Lists every registered scheduling mechanism: kind, name, file, paper section, and the presets
(configs/sched/*.toml) that use it. Run from any other directory, `python -m sched` is the standard
library's sched module and prints nothing: cd to the repository root, or set PYTHONPATH to it."""


def main(argv: list[str] | None = None) -> int:
    argv = argv or []
    if argv:
        if argv[0] in ("-h", "--help"):
            print(USAGE)
            return 0
        print(f"python -m sched: takes no arguments, got {' '.join(argv)!r} (python -m sched --help)", file=sys.stderr)
        return 2
    table = rows()
    head = ("kind", "name", "file", "paper section", "presets")
    widths = [max(len(r[i]) for r in table + [head]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[4])
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
