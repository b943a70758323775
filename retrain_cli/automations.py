"""`retrain automations`: install the shipped Prefect automations on the configured server.

Each `*.yaml` file of the folder is one automation (the format of `prefect automation create
--from-file`). An automation is found by its name and updated, or created: running the command
again, as every deploy does, changes nothing twice. A file still holding a placeholder to fill
in (`REPLACE-WITH-...`) is skipped with a line saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import yaml

from training.errors import ConfigError

__all__ = ["install_automations"]

PLACEHOLDER = "REPLACE-WITH-"


def install_automations(folder: Path, say: Callable[[str], None]) -> list[str]:
    """Create or update every automation in `folder`; the names of those installed."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        raise ConfigError("no Prefect server configured: set PREFECT_API_URL to the server your deployments are on")
    files = sorted(folder.glob("*.yaml"))
    if not files:
        raise ConfigError(f"{folder} holds no automation files (*.yaml); run from the repository root or pass --dir")
    installed = []
    for path in files:
        text = path.read_text()
        if PLACEHOLDER in text:
            say(f"skipped {path}: fill in its {PLACEHOLDER}... value first (see the comment at its top)")
            continue
        installed.append(_upsert(path, text, say))
    return installed


def _upsert(path: Path, text: str, say: Callable[[str], None]) -> str:
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore
    from pydantic import ValidationError

    try:
        automation = AutomationCore.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValidationError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path} is not a valid automation: {first}") from None
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(automation.name)
        if existing:
            client.update_automation(existing[0].id, automation)
            for duplicate in existing[1:]:  # made by hand, or by `prefect automation create` twice
                client.delete_automation(duplicate.id)
            say(f"updated automation {automation.name} ({path})")
        else:
            client.create_automation(automation)
            say(f"created automation {automation.name} ({path})")
    return automation.name
