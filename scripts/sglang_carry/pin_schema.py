"""The schema of a pin file (``upstream/<name>.toml``), checked field by field.

Every way a pin file can be wrong is one `PinFileError` line that names the file, the release and
the field, says what it must be and what it is: a wrong TOML type (`files = "x"`, `url = 42`, an
unquoted `version = 0.5`) was a traceback, and a `name` that is not the file's silently dropped
the package it belonged to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import CarryError

TOP_LEVEL_FIELDS = ("name", "source_subdir", "release")
RELEASE_FIELDS = ("version", "git_tag", "files", "test_env", "ci")
FILE_FIELDS = ("filename", "sha256", "url")


class PinFileError(CarryError):
    """A pin file that does not follow the schema."""


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class Place:
    """Where in a pin file a value sits, for the error line."""

    path: Path
    within: str = ""

    def inside(self, what: str) -> Place:
        return Place(self.path, f"{self.within} {what}".strip())

    def error(self, problem: str) -> PinFileError:
        where = f"{self.path}" + (f" ({self.within})" if self.within else "")
        return PinFileError(f"{where}: {problem}")


def check_fields(table: Mapping[str, object], known: tuple[str, ...], place: Place) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise place.error(f"unknown field '{unknown[0]}' (the fields here are: {', '.join(known)})")


def string(
    table: Mapping[str, object], key: str, place: Place, required: bool = True, allow_empty: bool = False
) -> str | None:
    value = table.get(key)
    if value is None:
        if required:
            raise place.error(f"missing field '{key}' (a string)")
        return None
    if not isinstance(value, str):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        hint = f' (quote it: {key} = "{value}")' if number else ""
        raise place.error(f"'{key}' must be a string, not {_kind(value)}{hint}")
    if not value and not allow_empty:
        raise place.error(f"'{key}' is empty")
    return value


def required_string(table: Mapping[str, object], key: str, place: Place) -> str:
    """A field every such table must have, a non-empty string."""
    value = string(table, key, place)
    assert value is not None  # string() raises for a missing required field
    return value


def tables(table: Mapping[str, object], key: str, place: Place, header: str) -> list[Mapping[str, object]]:
    """A TOML array of tables (``[[header]]``)."""
    value = table.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise place.error(f"'{key}' must be [[{header}]] tables, not {_kind(value)}")
    odd = [item for item in value if not isinstance(item, dict)]
    if odd:
        raise place.error(f"'{key}' must be [[{header}]] tables, not a list holding {_kind(odd[0])}")
    return value


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise Place(path).error(f"is not UTF-8 (byte {exc.start}): save it as UTF-8") from exc
    except OSError as exc:
        raise Place(path).error(f"cannot read it ({exc.strerror or exc})") from exc
