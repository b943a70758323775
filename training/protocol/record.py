"""The base of the values that cross a boundary (a process, a stage, a file): frozen, and read
back tolerantly (`extra="ignore"`), so that a file a newer or older version wrote still loads."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Record"]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
