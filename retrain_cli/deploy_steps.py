"""Steps that `prefect deploy` runs from deployments/prefect.yaml (importable: the project is
installed where it deploys)."""

from __future__ import annotations

import os
import subprocess

__all__ = ["image_tag", "require_environment"]


def require_environment(name: str, hint: str) -> dict[str, str]:
    """Stop the deploy with one line when the environment variable `name` is unset or empty.

    SystemExit, not an exception: Prefect's CLI prints any exception from a step with two
    tracebacks around the message, while SystemExit passes through it as the one line and exit
    status 1. Returns {name: value} for later steps."""
    value = os.environ.get(name, "")
    if not value.strip():
        raise SystemExit(f"prefect deploy: {name} is not set; {hint}")
    return {name: value}


def image_tag(name: str, hint: str, suffix: str = "") -> dict[str, str]:
    """The image repository (environment variable `name`, required as `require_environment`
    requires it) and the tag to build: the checkout's commit, plus `suffix` (e.g. the CUDA
    variant), so a deployment runs the exact code it was deployed from."""
    image = require_environment(name, hint)[name]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit("prefect deploy: the image is tagged with the commit, and this folder is not a git "
                         "checkout; run `prefect deploy` from the repository's root") from None
    return {"image": image, "tag": commit + suffix}
