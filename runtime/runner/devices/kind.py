"""What a backend registers to be chosen by `--backend`, and what looks it up."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.load import ExpectedLoad
from edgeprefill.runtime.core.registry import Registry

Options = dict[str, Any]  # the command's parsed options, by parameter name
# What an open device yields: a factory of the backend each run uses, and the profile.
Opened = tuple[Callable[[], Any], DeviceProfile | None]
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def option(decls: str, default: Any = None, help: str = "", **kwargs: Any) -> Decorator:
    """A command-line option, `--help` showing its default unless the help says what the
    default means in words ("[default: ...]"): one rule for every option of every command."""
    shown = "[default:" not in help
    return click.option(*decls.split(), default=default, show_default=shown, help=help, **kwargs)


@dataclass(frozen=True)
class DeviceKind:
    name: str
    help: str  # one line for `--backend`'s help
    open: Callable[[Options, ExpectedLoad | None], AbstractContextManager[Opened]]
    title: str  # the heading of its option group
    options: tuple[Decorator, ...] = ()  # options only this backend reads
    ignores: dict[str, str] = field(
        default_factory=dict
    )  # shared options it has no use for, and why
    check: Callable[[Options], None] = field(default=lambda o: None)  # before any loading

    def __call__(self, o: Options, load: ExpectedLoad | None) -> AbstractContextManager[Opened]:
        return self.open(o, load)

    @property
    def own(self) -> set[str]:
        """The parameter names of its options."""
        return set(param_names(self.options))


def param_names(options: tuple[Decorator, ...]) -> list[str]:
    def target() -> None: ...

    for option in options:
        option(target)  # click collects the parameter on the function
    params: list[click.Parameter] = getattr(target, "__click_params__", [])
    return [p.name for p in params if p.name]


DEVICES: Registry[DeviceKind] = Registry("backend")


def kinds() -> list[DeviceKind]:
    return [DEVICES.get(name) for name in DEVICES.names()]


def check_options(o: Options, given: set[str], flag: Callable[[str], str]) -> DeviceKind:
    """The device `--backend` names, once no option given is one it would ignore."""
    kind = DEVICES.get(o["backend"])
    others = {name: k.name for k in kinds() if k is not kind for name in k.own}
    for name in sorted(given):
        why = f"it is --backend {others[name]}'s" if name in others else kind.ignores.get(name)
        if why is not None:
            raise UserError(
                f"{flag(name)} does not apply to --backend {kind.name} ({why}): drop it"
            )
    kind.check(o)
    return kind


def open_device(o: Options, load: ExpectedLoad | None = None) -> AbstractContextManager[Opened]:
    """The backend the options name, set up for the `load` the command will run, and the
    device profile policies default from."""
    kind = DEVICES.get(o["backend"])
    return kind(o, load)


def device_profile(calibration: str, backend: Any) -> DeviceProfile | None:
    """The device profile `--calibration` names: measured now, none, or from a file."""
    from edgeprefill.runtime.runner.calibration import load_profile, probe_device

    if calibration == "probe":
        return probe_device(backend)
    if calibration == "none":
        return None
    return load_profile(Path(calibration))
