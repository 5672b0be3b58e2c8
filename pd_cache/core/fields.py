"""Field checks and readers shared by every config dataclass.

Every check raises ``ValueError`` naming the field (never ``assert``: ``python -O`` strips
it). ``read_text`` turns an environment or command-line string into a field's type, and
``from_mapping`` builds a config dataclass from a mapping (a Serve config's ``args``),
refusing unknown keys and wrong types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

# NOTE: 5% of the disk backend's filesystem stays free: room for the OS, logs and the
# temporary file of a write in flight, on a disk shared with other services.
DISK_RESERVE = 0.05
# NOTE: a write thread is only ever lowered to this. Ray starts its worker processes at nice 15
# (RAY_worker_niceness) and their Python threads inherit it, so in a Ray worker this changes
# nothing (docs/benchmarks.md: the A/B that seemed to favour it measured noise).
WRITE_NICE = 10


def check(ok: bool, field_name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: expected {expected}, got {value!r}")


def check_int_at_least(field_name: str, value: Any, low: int) -> None:
    check(isinstance(value, int) and not isinstance(value, bool) and value >= low,
          field_name, value, f"an int >= {low}")


def check_positive_int(field_name: str, value: Any) -> None:
    check_int_at_least(field_name, value, 1)


def check_non_negative(field_name: str, value: Any) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
          field_name, value, "a number >= 0")


def check_positive(field_name: str, value: Any) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
          field_name, value, "a number > 0")


def check_fraction(field_name: str, value: Any) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1,
          field_name, value, "a fraction in [0, 1]")


def check_disk_reserve(field_name: str, value: Any) -> None:
    """A fraction of a filesystem in [0, 1), or a whole number of bytes >= 1."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    check(number and math.isfinite(value) and value >= 0 and (value < 1 or value == int(value)),
          field_name, value, "a fraction of the filesystem in [0, 1) or bytes (a whole "
          "number >= 1)")


def disk_reserve_bytes(reserve: float, filesystem_bytes: int) -> int:
    """The bytes ``reserve`` (checked by :func:`check_disk_reserve`) keeps free."""
    return int(reserve) if reserve >= 1 else math.ceil(reserve * filesystem_bytes)


def check_bool(field_name: str, value: Any) -> None:
    check(isinstance(value, bool), field_name, value, "a bool")


def one_of(field_name: str, value: Any, choices: tuple[str, ...]) -> None:
    check(value in choices, field_name, value, f"one of {list(choices)}")


def help_of(f: dataclasses.Field[Any]) -> str:
    """A field's help text (``metadata={"help": ...}``), for flags and docs."""
    return str(f.metadata.get("help", ""))


def read_text(key: str, text: str, type_name: Any) -> Any:
    """``text`` as the field type named ``type_name`` (``int``, ``float``, ``bool``, ``str``
    or ``str | None``); ``ValueError`` naming ``key`` if it cannot be read."""
    kind = str(type_name)
    try:
        if kind == "bool":
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return text.lower() in ("1", "true", "yes")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"{key}: cannot read {text!r} as {kind}") from None
    return text


def from_mapping(cls: type[T], values: Mapping[str, Any], where: str = "") -> T:
    """``cls(**values)`` with types checked and unknown keys refused, naming the key."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}{unknown[0]}: unknown field; expected one of "
                         f"{sorted(names)}")
    try:
        return msgspec.convert(dict(values), cls)
    except msgspec.ValidationError as exc:
        at = str(exc).rpartition("`$.")[2].rstrip("`")
        if at == str(exc):   # a check of the class's own: its message names the field
            raise ValueError(f"{where}{exc}") from None
        raise ValueError(f"{where}{at}: {exc}") from None
