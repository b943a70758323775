"""Steps that `prefect deploy` runs from deployments/prefect.yaml (importable: the project is
installed where it deploys)."""

from __future__ import annotations

import os

__all__ = ["require_environment"]


def require_environment(name: str, hint: str) -> dict[str, str]:
    """Stop the deploy with one line when the environment variable `name` is unset or empty.

    SystemExit, not an exception: Prefect's CLI prints any exception from a step with two
    tracebacks around the message, while SystemExit passes through it as the one line and exit
    status 1. Returns {name: value} for later steps."""
    value = os.environ.get(name, "")
    if not value.strip():
        raise SystemExit(f"prefect deploy: {name} is not set; {hint}")
    return {name: value}
