"""Checks of scalar arguments (ints, bools, numbers), shared by the constructors and options of the Python API.

Every message starts with the argument's name and what was expected, then what was given, the same for a value of
the wrong type (TypeError: the type is named) and a wrong value of the right type (ValueError):

    "hidden: expected a positive multiple of 64, got 100"
    "hidden: expected a positive multiple of 64, got bool True"

bool is not an int here (True as a size is a bug, not a 1), and an int is not a bool. The bounds of the C++ types
the values end in (int32 and int64 fields of include/mok/moe.h, include/mok/routing.h) are checked too, so that no
value is truncated or refused by the binding with a message that does not name it.
"""
from __future__ import annotations

import numbers
from typing import Callable

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


def describe(value) -> str:
    """A value of the wrong type as the messages show it: its type's name, then its repr (cut at 80 characters)."""
    return f"{type(value).__name__} {value!r:.80}"


def _fail(name: str, expected: str, value, error=ValueError):
    shown = describe(value) if error is TypeError else repr(value)
    raise error(f"{name}: expected {expected}, got {shown}")


def check_int(name: str, value, expected: str, ok: Callable[[int], bool] = lambda v: True,
              maximum: int = INT32_MAX) -> int:
    """value as an int: an integral number (not a bool) with ok(value) and value <= maximum (the C++ type's
    bound); TypeError or ValueError naming `name` otherwise. `expected` spells the rule, e.g. "a positive int"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, expected, value, TypeError)
    if not ok(int(value)):
        _fail(name, expected, value)
    if int(value) > maximum:
        _fail(name, f"{expected} up to {maximum}", value)
    return int(value)


def check_bool(name: str, value) -> bool:
    """value if it is a bool (True or False; not an int, not None); TypeError naming `name` otherwise."""
    if not isinstance(value, bool):
        _fail(name, "a bool (True or False)", value, TypeError)
    return value


def check_number(name: str, value, expected: str, ok: Callable[[float], bool]) -> float:
    """value as a float: a real number (not a bool) with ok(value) (NaN fails any comparison, so ok rejects it
    unless it asks for it); TypeError or ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, expected, value, TypeError)
    if not ok(float(value)):
        _fail(name, expected, value)
    return float(value)


def check_type(name: str, value, cls, expected: str, allow_none: bool = False):
    """value if it is an instance of cls (or None with allow_none); TypeError naming `name` otherwise."""
    if value is None and allow_none:
        return value
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")
    return value

