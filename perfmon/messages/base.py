"""What every message type shares: ``seq``, field conversion by annotation, merging facts sent in pieces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

T = TypeVar("T")


def num(v: Any) -> float | None:
    """A JSON number as it came (an int stays an int: the report writes it back), else None."""
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def integer(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def flag(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def texts(v: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in v) if isinstance(v, list | tuple) else ()


def counts(v: Any) -> dict[str, float] | None:
    return {str(k): n for k, n in v.items() if num(n) is not None} if isinstance(v, dict) else None


#: How a field is read, by its annotation as written (a string: ``from __future__ import annotations``);
#: the modules defining record types add theirs.
CONVERT: dict[str, Callable[[Any], Any]] = {
    "float | None": num, "int | None": integer, "str | None": text, "bool | None": flag,
    "tuple[str, ...]": texts, "dict[str, float] | None": counts,
    "int | str | None": lambda v: v if isinstance(v, int | str) and not isinstance(v, bool) else None,
}
_PLANS: dict[type, tuple[list[tuple[str, Callable[[Any], Any]]], bool]] = {}


def record(cls: type[T], d: dict[str, Any], **extra: Any) -> T:
    """``cls`` from the keys of ``d`` it has fields for, each converted by its annotation; a class with a
    ``given`` field learns which keys were there."""
    plan = _PLANS.get(cls)
    if plan is None:
        names = fields(cls)  # type: ignore[arg-type]
        read = [(f.name, CONVERT[str(f.type)]) for f in names if f.name not in ("seq", "given")]
        plan = _PLANS[cls] = (read, any(f.name == "given" for f in names))
    values = {name: convert(d[name]) for name, convert in plan[0] if name in d}
    if plan[1]:
        values["given"] = frozenset(values)
    return cls(**values, **extra)


def records(cls: type[T], v: Any) -> tuple[T, ...]:
    """A list of ``cls`` records; items that are not objects are dropped."""
    return tuple(record(cls, d) for d in v if isinstance(d, dict)) if isinstance(v, list | tuple) else ()


def as_sent(rec: Any) -> dict[str, Any]:
    """The fields of a record that its message carried (all, for a record that does not track them), as
    JSON values in field order: what findings and reports write back out."""
    given = getattr(rec, "given", None)

    def value(v: Any) -> Any:
        if isinstance(v, tuple):
            return [value(x) for x in v]
        return as_sent(v) if hasattr(v, "__dataclass_fields__") else v

    return {f.name: value(getattr(rec, f.name)) for f in fields(rec)
            if f.name not in ("seq", "given") and (given is None or f.name in given)}


def merged(old: T, new: T) -> T:
    """``old`` with the fields that ``new``'s message carried (facts that come in pieces)."""
    given: frozenset[str] = new.given  # type: ignore[attr-defined]
    changes = {k: getattr(new, k) for k in given}
    return replace(old, **changes, given=old.given | given)  # type: ignore[attr-defined,type-var]


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Any parsed message; ``seq`` numbers the agent's messages (None: unnumbered)."""

    seq: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Reset(Message):
    """A replay restarting from the beginning (never from a socket or a file)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Other(Message):
    """A message the monitor's state does not read (``log``, other event kinds)."""

    type: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Invalid(Message):
    """A message that cannot be read: counted as skipped."""

    what: str
