"""Scheduling: the controller and its contract (this package's modules), and the mechanisms of the papers
(sched/policies/, one module or folder per paper). Papers and baselines are presets: configs/sched/<name>.toml
names one registered mechanism per kind and its parameters.

`load_preset` turns a preset name and a run config's [sched] overrides into a `Preset` of five mechanism objects;
it imports sched.policies, which registers the built-in mechanisms. Nothing else in this package imports a policy.
`python -m sched` prints the registry: kind, name, file, paper section.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Mapping, Sequence

from config import load_config
from sched.base import KIND_BASES, REGISTRY, Preset
from sched.build import build_policy

PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "sched"


def preset_tables(name: str, source: str | None = None) -> dict[str, dict[str, Any]]:
    """The per-kind tables of a named preset file configs/sched/<name>.toml. An unknown name is a ValueError that
    names where it came from (`source`: a file or "command line"), the closest preset and every preset."""
    import tomllib
    f = PRESET_DIR / f"{name}.toml"
    if not f.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.toml"))
        close = difflib.get_close_matches(str(name), known, n=1)
        raise ValueError(f"sched.preset = {name!r}{f' (from {source})' if source else ''}: no file "
                         f"configs/sched/{name}.toml{f'; did you mean {close[0]}?' if close else '.'} "
                         f"Presets: {', '.join(known)}")
    with open(f, "rb") as fh:
        data = tomllib.load(fh)
    unknown = sorted(set(data) - set(KIND_BASES))
    if unknown:
        raise ValueError(f"{f}: unknown mechanism kinds {unknown}; kinds: {sorted(KIND_BASES)}")
    return data


def load_preset(preset: str, overrides: Mapping[str, Mapping[str, Any]] | None = None,
                key_sources: Mapping[str, str] | None = None) -> Preset:
    """Preset file first, then per-kind overrides from the run config (a different `name` replaces the module
    and its parameters; the same name updates parameters). Every table is validated by config.build; errors name
    the key and where it came from (`key_sources`: the run config's, dotted key -> file or "command line")."""
    import sched.policies  # noqa: F401  (registers the built-in mechanisms)
    tables = preset_tables(preset, (key_sources or {}).get("sched.preset"))
    for kind, table in (overrides or {}).items():
        if not table:
            continue
        base = tables.get(kind, {})
        tables[kind] = {**base, **table} if table.get("name", base.get("name")) == base.get("name") else dict(table)
    missing = sorted(k for k in KIND_BASES if k not in tables and k != "rebalance")
    if missing:
        raise ValueError(f"sched preset {preset!r} names no module for {missing}")
    tables.setdefault("rebalance", {"name": "none"})
    source = f"configs/sched/{preset}.toml"
    return Preset(**{k: build_policy(k, tables[k], source, f"sched.{k}", key_sources) for k in KIND_BASES})


def command_line_overrides(args: Sequence[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """(per-kind override tables, their key sources) from `--sched.KIND=NAME` / `--sched.KIND.PARAM=V` arguments,
    read by config.load_config exactly as train.py reads them; pass both to `load_preset`. For a tool that runs
    presets without a run config (python -m sim.compare). Raises ValueError (a ConfigError) on a bad argument."""
    for a in args:
        if not a.startswith("--sched.") or a.startswith("--sched.preset"):
            raise ValueError(f"unrecognized argument {a!r}: only --sched.KIND=NAME and --sched.KIND.PARAM=V overrides "
                             "are taken here")
    cfg = load_config(None, args)
    return cfg.sched.overrides(), cfg.sources


__all__ = ["REGISTRY", "Preset", "command_line_overrides", "load_preset", "preset_tables"]
