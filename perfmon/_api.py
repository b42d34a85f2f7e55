"""The hand-off point between the public API and a running agent (no torch, no imports)."""

from __future__ import annotations

from typing import Any

_agent: Any = None


def set_agent(agent: Any) -> None:
    global _agent
    _agent = agent


def get_agent() -> Any:
    return _agent
