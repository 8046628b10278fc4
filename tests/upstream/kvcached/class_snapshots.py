"""Undoing kvcached's patches: kvcached patches SGLang's classes and modules in place, so a test
snapshots what it will touch and restores it afterwards."""

from __future__ import annotations

from typing import Any


def snapshot(obj: Any) -> dict[str, Any]:
    return dict(vars(obj))


def restore(obj: Any, saved: dict[str, Any]) -> None:
    for name in set(vars(obj)) - set(saved):
        delattr(obj, name)
    for name, value in saved.items():
        if vars(obj).get(name) is not value:
            setattr(obj, name, value)
