"""Reading a learner's predictions: a ``predicted`` dict's entries checked for presence and type
before any comparison, so that a missing key, a string where a count is due or a bool reads as
what it is, not as a wrong number. Used by the checkers of chapter 08
(mgtutorial/exercises/ch08/).
"""

from __future__ import annotations

from typing import Any

from mgtutorial.exercises._common import answered, require


def entry(predicted: Any, key: Any, exercise: str, kind: Any = object, what: str = "") -> Any:
    """``predicted[key]``, :func:`answered`; raise if ``predicted`` is no dict or lacks ``key``,
    or if the value is no ``kind`` (type or tuple; a bool only as ``object``): "give <what>"."""
    name = f"predicted[{key!r}]"
    require(isinstance(predicted, dict), exercise, "`predicted` is not a dict: give a dict")
    require(key in predicted, exercise, f"`{name}` is missing: add the key {key!r} to the dict")
    value = answered(predicted[key], exercise, name)
    ok = isinstance(value, kind) and (kind is object or not isinstance(value, bool))
    require(ok, exercise, f"`{name}` is {value!r} ({type(value).__name__}): give {what}")
    return value


def is_int(value: Any) -> bool:
    """An int, not a bool (``True`` is an ``int`` to Python, never a learner's count)."""
    return isinstance(value, int) and not isinstance(value, bool)
