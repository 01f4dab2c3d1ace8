"""Scheduling policies: one mechanism per module, papers are presets of them (configs/sched/*.toml).

Importing this package registers every built-in module; `load_preset` turns a config's [sched] section into
a `Preset` of five policy objects.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sched import barrier, fifo, step_publish, whole_round  # noqa: F401  (registration)
from sched import cgp, every_u, frontier, skewness, stream_handoff, stream_update, tail_abort, tail_batching  # noqa: F401
from sched import experience_buffer, laminar_dispatch, one_step, one_step_handoff, partial_rollout, pull_latest, repack  # noqa: F401,E501
from sched import areal_dispatch, areal_handoff, areal_sync, staleflow_handoff, staleflow_migrate, staleflow_route, staleflow_route_vanilla, staleflow_sync, staleflow_sync_vanilla  # noqa: F401,E501
from sched.base import KIND_BASES, REGISTRY, Preset, build_policy

PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "sched"


def preset_tables(name: str) -> dict[str, dict[str, Any]]:
    """The per-kind tables of a named preset file configs/sched/<name>.toml."""
    import tomllib
    f = PRESET_DIR / f"{name}.toml"
    if not f.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.toml"))
        raise ValueError(f"sched.preset = {name!r}: no file {f}; presets: {known}")
    with open(f, "rb") as fh:
        data = tomllib.load(fh)
    unknown = sorted(set(data) - set(KIND_BASES))
    if unknown:
        raise ValueError(f"{f}: unknown mechanism kinds {unknown}; kinds: {sorted(KIND_BASES)}")
    return data


def load_preset(preset: str, overrides: dict[str, dict[str, Any]] | None = None,
                build_params: Callable[[type, dict, str], Any] | None = None) -> Preset:
    """Preset file first, then per-kind overrides from the run config (a different `name` replaces the module
    and its parameters; the same name updates parameters)."""
    tables = preset_tables(preset)
    for kind, table in (overrides or {}).items():
        if not table:
            continue
        base = tables.get(kind, {})
        tables[kind] = {**base, **table} if table.get("name", base.get("name")) == base.get("name") else dict(table)
    missing = sorted(k for k in KIND_BASES if k not in tables and k != "rebalance")
    if missing:
        raise ValueError(f"sched preset {preset!r} names no module for {missing}")
    tables.setdefault("rebalance", {"name": "none"})
    return Preset(**{k: build_policy(k, tables[k], build_params, f"sched preset {preset!r}") for k in KIND_BASES})


__all__ = ["REGISTRY", "Preset", "load_preset", "preset_tables"]
