"""Policies by name, as the command line gives them: `static:64`, `dlfp:target_ms=80`."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.registry import Registry

POLICIES: Registry[type[BudgetPolicy]] = Registry("policy")


def policy_usage() -> str:
    """Every registered policy with its parameters, for a command's help."""
    forms = []
    for name in POLICIES.names():
        factory = POLICIES.get(name)
        found: tuple[dataclasses.Field[Any], ...] = ()
        if dataclasses.is_dataclass(factory):
            found = dataclasses.fields(factory)
        fields = [f.name for f in found if f.init]
        forms.append(f"{name}[:{'=,'.join(fields)}=]" if fields else name)
    return ", ".join(forms)


def baseline_policies() -> list[str]:
    """The policies `compare` and `sweep` take ratios against unless told otherwise."""
    return [name for name in POLICIES.names() if POLICIES.get(name).baseline]


def parse_policy(spec: str) -> BudgetPolicy:
    """Build a policy from `name`, `name:VALUE` (its first parameter) or `name:k=v,k=v`."""
    name, _, argstr = spec.strip().partition(":")
    factory = POLICIES.get(name)
    if not dataclasses.is_dataclass(factory):  # its fields are its parameters
        raise TypeError(f"policy {name!r} is registered as {factory!r}, not a dataclass")
    fields = [f for f in dataclasses.fields(factory) if f.init]
    hints = typing.get_type_hints(factory)
    usage = ",".join(f"{f.name}=..." for f in fields) or "no parameters"
    kwargs: dict[str, Any] = {}
    for i, part in enumerate(p for p in argstr.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq:
            if i > 0 or not fields:
                raise UserError(f"`policy` {spec!r}: unexpected {part!r}; {name} takes {usage}")
            key, value = fields[0].name, part
        key = key.strip()
        if key not in {f.name for f in fields}:
            raise UserError(f"`policy` {spec!r}: unknown parameter {key!r}; {name} takes {usage}")
        kind = next(
            a for a in (typing.get_args(hints[key]) or (hints[key],)) if a is not type(None)
        )
        try:
            kwargs[key] = kind(value.strip())
        except ValueError:
            raise UserError(
                f"`policy` {spec!r}: {key} must be {kind.__name__}, got {value!r}"
            ) from None
        if kind is float and not math.isfinite(kwargs[key]):
            raise UserError(f"`policy` {spec!r}: {key} must be a finite number, got {value!r}")
    try:
        return factory(**kwargs)
    except ValueError as e:
        raise UserError(f"`policy` {spec!r}: {e}") from None
