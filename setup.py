"""Package discovery. The repository keeps the mission's fixed layout (runtime/, backends/,
thermal/) while everything installs under the `edgeprefill.` namespace, so nothing generic
such as `runtime` lands at the top level of site-packages. Every package below those folders
is found, not listed: a hand-written list once missed two and the installed command failed
on import (`tests/test_wheel.py` installs the wheel and runs it)."""

from setuptools import find_packages, setup

LAYERS = ("runtime", "backends", "thermal")

setup(
    packages=[
        f"edgeprefill.{package}"
        for layer in LAYERS
        for package in (layer, *(f"{layer}.{sub}" for sub in find_packages(layer)))
    ],
    package_dir={f"edgeprefill.{layer}": layer for layer in LAYERS},
    package_data={"edgeprefill.runtime.server": ["page.html"]},
)
