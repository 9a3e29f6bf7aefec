"""The devices a command can run on, by `--backend` name.

Each backend registers a `DeviceKind` (`kind`): how it opens (its backend, and the device
profile policies default from), the command-line options only it reads, and the shared
options it has no use for. The command line builds its option groups from them and
`open_device` looks the backend up: adding a backend adds a module here, not a branch
elsewhere. Importing a backend's module registers it; none imports its backend's library.
"""

from edgeprefill.runtime.runner.devices.kind import (
    DEVICES,
    DeviceKind,
    check_options,
    kinds,
    open_device,
)
from edgeprefill.runtime.runner.devices.llamacpp import LLAMACPP
from edgeprefill.runtime.runner.devices.sim import SIM
from edgeprefill.runtime.runner.devices.vllm import VLLM

__all__ = [
    "DEVICES",
    "LLAMACPP",
    "SIM",
    "VLLM",
    "DeviceKind",
    "check_options",
    "kinds",
    "open_device",
]
