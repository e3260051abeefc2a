"""The example record shared by environments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    index: int
    prompt: str
    answer: str
