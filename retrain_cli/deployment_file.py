"""The config a deployment of a prefect.yaml runs with: its `parameters.config`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from training.errors import ConfigError

__all__ = ["deployment_config"]


def deployment_config(path: Path, name: str) -> dict[str, Any]:
    """`parameters.config` of deployment `name` in `path` (YAML anchors resolved); one clear
    line when the file, the deployment or its config is missing."""
    try:
        spec = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"deployment file {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"deployment file {path} cannot be read ({err.strerror or err})") from None
    except yaml.YAMLError:
        raise ConfigError(f"deployment file {path} is not valid YAML") from None
    deployments = spec.get("deployments") if isinstance(spec, dict) else None
    if not isinstance(deployments, list):
        raise ConfigError(f"{path} has no deployments list: name a prefect.yaml")
    names = [d.get("name") for d in deployments if isinstance(d, dict)]
    found = next((d for d in deployments if isinstance(d, dict) and d.get("name") == name), None)
    if found is None:
        raise ConfigError(f"{path} has no deployment '{name}' (it has: {', '.join(map(str, names)) or 'none'}); give "
                          "--deployment FILE.yaml:NAME")
    config = (found.get("parameters") or {}).get("config")
    if not isinstance(config, dict):
        raise ConfigError(f"deployment '{name}' in {path} sets no parameters.config")
    return config
