"""Range checks that every worker configuration's ``validate`` shares, so a bad value is refused in
the launcher (before any rank starts) with a message naming the field, its value and the fix.

Used by the config dataclasses of every chapter (``DDPConfig.validate`` in notebooks/02_ddp.ipynb,
``PipelineConfig`` in notebooks/04_model_parallel.ipynb, …) and so by the command line.
"""

from __future__ import annotations

import math


def _number(cfg, name: str) -> float:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number.")
    return value


def at_least(cfg, minimum: float, *names: str, hint: str = "") -> None:
    """Raise ``ValueError`` unless every field in ``names`` is a finite number ≥ ``minimum``."""
    for name in names:
        if (value := _number(cfg, name)) < minimum:
            raise ValueError(f"{name}={value!r}: must be at least {minimum}{hint}.")


def positive(cfg, *names: str) -> None:
    """Raise ``ValueError`` unless every field in ``names`` is a finite number > 0."""
    for name in names:
        if (value := _number(cfg, name)) <= 0:
            raise ValueError(f"{name}={value!r}: must be positive.")


def rank_or_none(cfg, name: str, count: int, what: str = "rank") -> None:
    """A fault-injection target: −1 (none) or one of the job's ``count`` ranks (or stages), 0 … count − 1."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < count:
        raise ValueError(
            f"{name}={value!r}: must be -1 (none) or a {what} of the job, 0 … {count - 1} "
            f"({count} {what}s)."
        )
