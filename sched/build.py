"""Building mechanisms from config tables: one registered module by name, its parameters validated by config.build
(types, ranges, choices; errors name the key and where it came from), and the inner dispatch a round-composing
dispatch delegates placement to."""
from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any, Mapping

from config import build
from sched.base import REGISTRY, Dispatch, Policy

def build_policy(kind: str, table: Mapping[str, Any], source: str = "config", prefix: str = "",
                 key_sources: Mapping[str, str] | None = None) -> Policy:
    """Instantiate one mechanism from its config table `{name = "...", <params>}`, its parameters validated by
    config.build (types, declared ranges and choices; errors name `prefix`.key and where it came from)."""
    if kind not in REGISTRY:
        raise ValueError(f"{source}: unknown mechanism kind {kind!r}; kinds: {sorted(REGISTRY)}")
    prefix = prefix or f"sched.{kind}"
    table = dict(table)
    name = table.pop("name", None)
    if name not in REGISTRY[kind]:
        close = difflib.get_close_matches(str(name), REGISTRY[kind], n=1)
        where = (key_sources or {}).get(f"{prefix}.name", source)
        hint = f"; did you mean {close[0]}?" if close else "."
        raise ValueError(f"{prefix}.name = {name!r} is not a registered {kind} module (from {where}){hint} "
                         f"Available: {', '.join(sorted(REGISTRY[kind]))}")
    cls = REGISTRY[kind][name]
    if table and not fields(cls.Params):
        key = sorted(table)[0]
        raise ValueError(f"{prefix}.{key} (from {(key_sources or {}).get(f'{prefix}.{key}', source)}): {prefix} "
                         f"{name!r} takes no parameters")
    return cls(build(cls.Params, table, source, prefix, key_sources=key_sources))


def inner_dispatch(owner: Dispatch, name: str, params: Mapping[str, Any]) -> Dispatch:
    """The dispatch module a round-composing dispatch delegates placement to (`admit = "<name>"`, `admit_params`),
    validated like any other table."""
    if name == owner.name or name not in REGISTRY["dispatch"]:
        raise ValueError(f"sched.dispatch {owner.name!r}: admit = {name!r} is not a dispatch module it can delegate "
                         f"to; available: {sorted(set(REGISTRY['dispatch']) - {owner.name})}")
    inner = build_policy("dispatch", {"name": name, **params}, source=f"sched.dispatch {owner.name!r}",
                         prefix="sched.dispatch.admit_params")
    assert isinstance(inner, Dispatch)
    return inner
