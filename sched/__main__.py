"""python -m sched: every registered scheduling mechanism as a table of kind, name, file and paper section, and
which presets (configs/sched/*.toml) use it."""
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


def main() -> int:
    table = rows()
    head = ("kind", "name", "file", "paper section", "presets")
    widths = [max(len(r[i]) for r in table + [head]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[4])
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
