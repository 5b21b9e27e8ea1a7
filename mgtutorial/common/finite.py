"""A diverging run stops at the first loss that is not a finite number, with an error that names
the step and the likely cause, instead of training on NaN and reporting success.

Every training loop that logs a loss calls :func:`check_loss` once per step: chapter 02's
:class:`~mgtutorial.ddp.trainer.Trainer` (and so every chapter that subclasses it), the pipeline
worker of chapter 04, chapter 07's sharded loops and chapter 08b's 2-D mesh. Once one step's loss
is NaN or infinite, every later step's is too (the weights themselves are no longer numbers), so
nothing is lost by stopping there. Taught in notebooks/01_single_device.ipynb (the learning rate).
"""

from __future__ import annotations

import dataclasses
import math


class LossNotFinite(FloatingPointError):
    """The training loss became NaN or infinite. Attributes: ``step`` (the optimizer step that
    produced it, counted from 1), ``loss`` (the value)."""

    def __init__(self, message: str, step: int, loss: float):
        super().__init__(message)
        self.step, self.loss = step, loss


def likely_cause(cfg) -> str:
    """The settings of ``cfg`` that make a loss blow up, each with its value and its default:
    the learning rate ``lr`` and, where the config has one, the SGD ``momentum`` (those changed
    from their defaults, when any was)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)} if cfg is not None else {}
    names = [name for name in ("lr", "momentum") if name in defaults]
    changed = [name for name in names if getattr(cfg, name) != defaults[name]]
    named = [f"{n}={getattr(cfg, n)!r} (default {defaults[n]!r})" for n in changed or names]
    if not named:
        return "a learning rate too large for this model and data"
    return " or ".join(named) + " is too large for this model and data: lower it"


def check_loss(loss: float, *, step: int, cfg=None) -> float:
    """Return ``loss`` if it is a finite number; else raise :class:`LossNotFinite` naming
    ``step`` and the likely cause (:func:`likely_cause` of the run's config ``cfg``).

    Raises:
        LossNotFinite: ``loss`` is NaN or ±inf.
    """
    if math.isfinite(loss):
        return loss
    raise LossNotFinite(
        f"the loss is {loss} at step {step}: training diverged, and every later step would train "
        f"on {loss}. Likely cause: {likely_cause(cfg)}.",
        step,
        loss,
    )
