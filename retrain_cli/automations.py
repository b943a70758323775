"""`retrain automations`: install the shipped Prefect automations on the configured server.

Each `*.yaml` file of the folder is one automation (the format of `prefect automation create
--from-file`). An automation is found by its name and updated, or created: running the command
again, as every deploy does, changes nothing twice. The notifying automations name their
notification block `NOTIFY-BLOCK-ID`: `--notify <block type>/<block name>` puts that block's
id there, and without it they are skipped with a line saying so. A file still holding another
placeholder to fill in (`REPLACE-WITH-...`) is skipped too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import yaml

from training.errors import ConfigError

__all__ = ["install_automations"]

PLACEHOLDER = "REPLACE-WITH-"
NOTIFY_BLOCK = "NOTIFY-BLOCK-ID"


def install_automations(folder: Path, say: Callable[[str], None], notify: str | None = None) -> list[str]:
    """Create or update every automation in `folder`; the names of those installed. `notify`:
    the notification block (`<block type slug>/<block name>`, or its id) the notifying ones use."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        raise ConfigError("no Prefect server configured: set PREFECT_API_URL to the server your deployments are on")
    files = sorted(folder.glob("*.yaml"))
    if not files:
        raise ConfigError(f"{folder} holds no automation files (*.yaml); run from the repository root or pass --dir")
    block_id = _block_id(notify) if notify is not None else None
    installed = []
    for path in files:
        text = path.read_text()
        if NOTIFY_BLOCK in text:
            if block_id is None:
                say(f"skipped {path}: it notifies; pass --notify <block type>/<block name> (a notification block "
                    "made in the UI, e.g. --notify slack-webhook/ml-alerts)")
                continue
            text = text.replace(NOTIFY_BLOCK, block_id)
        if PLACEHOLDER in text:
            say(f"skipped {path}: fill in its {PLACEHOLDER}... value first (see the comment at its top)")
            continue
        installed.append(_upsert(path, text, say))
    return installed


def _block_id(notify: str) -> str:
    """The id of the notification block `notify` names: `<block type slug>/<block name>`, or an id."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        return str(uuid.UUID(notify))
    except ValueError:
        pass
    slug, sep, name = notify.partition("/")
    if not sep or not slug or not name:
        raise ConfigError(f"--notify {notify!r}: expected <block type>/<block name>, e.g. slack-webhook/ml-alerts, "
                          "or the block's id")
    with get_client(sync_client=True) as client:
        try:
            block = client.read_block_document_by_name(name=name, block_type_slug=slug)
        except ObjectNotFound:
            raise ConfigError(f"--notify {notify}: no {slug} block named {name!r} on the server; create it in the UI "
                              "(Blocks -> +) or with its Python class's .save()") from None
    return str(block.id)


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
