"""What commands return, and the one way a result becomes JSON (`carry COMMAND --json`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class CommandResult(Protocol):
    @property
    def exit_code(self) -> int: ...


def to_json(value: object) -> Any:
    """A result as JSON values: dataclasses by their fields, enums by their value, paths as text;
    a property listed in a dataclass's ``json_extra`` (a ClassVar) is added beside its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        record = {field.name: to_json(getattr(value, field.name)) for field in dataclasses.fields(value)}
        for name in getattr(value, "json_extra", ()):
            record[name] = to_json(getattr(value, name))
        return record
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(key): to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(item) for item in value]
    return value
