"""The environment was installed from the lock: every installed distribution is pinned in
constraints.txt at the version installed. A dependency added to pyproject.toml without
regenerating the lock (so installed unpinned) fails here, and so does a lock that pip could not
honour."""

from __future__ import annotations

import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = Path(__file__).resolve().parents[1] / "constraints.txt"
# Installed by venv itself or the project: not dependencies the lock governs.
_NOT_LOCKED = {"pip", "setuptools", "wheel", "retrain-pipeline"}


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue  # another platform's or Python's pin
        (spec,) = req.specifier
        assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _installed() -> list[metadata.Distribution]:
    """The distributions installed in this environment's site-packages. Not every one on
    sys.path: importing setuptools (torch.compile's C++ build does) appends its `_vendor`
    folder, whose vendored copies (jaraco.text, tomli, ...) nobody installed."""
    paths = sysconfig.get_paths()
    return list(metadata.distributions(path=sorted({paths["purelib"], paths["platlib"]})))


def test_every_installed_distribution_is_pinned_in_the_lock() -> None:
    pins = _pins()
    unpinned, wrong = [], []
    for dist in _installed():
        name = canonicalize_name(dist.metadata["Name"])
        if name in _NOT_LOCKED:
            continue
        installed = Version(dist.version)
        if name not in pins:
            unpinned.append(f"{name}=={installed}")
        elif installed.public != pins[name].public:  # 2.13.0+cpu satisfies the pin 2.13.0
            wrong.append(f"{name}: installed {installed}, locked {pins[name]}")
    assert not unpinned, (f"installed but not in constraints.txt (regenerate it with the command in its header, "
                          f"then install with -c constraints.txt): {unpinned}")
    assert not wrong, f"installed versions differ from constraints.txt: {wrong}"


def test_no_cuda_stack_on_a_machine_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU machine may carry it
    cuda = sorted(canonicalize_name(d.metadata["Name"]) for d in _installed()
                  if canonicalize_name(d.metadata["Name"]).startswith(("nvidia-", "triton")))
    assert not cuda, f"CUDA packages on a machine without a GPU: {cuda}"
