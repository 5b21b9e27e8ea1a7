"""mgtutorial.common.config: Literal choices read from the type and refused by name, and the range
checks configs share (no process started)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from mgtutorial.common import config
from mgtutorial.hello import HelloConfig


@dataclasses.dataclass(kw_only=True)
class ToyConfig(config.Config):
    """A config with one field of each kind the checks know."""

    mode: Literal["fast", "exact"] = "fast"
    """A choice."""
    order: Literal[1, 2] | None = None
    """A choice that may be left unset."""
    name: str = "free"
    """Free text: no choices."""
    steps: int = 3
    """At least 1."""
    lr: float = 0.1
    """Positive."""
    fail_rank: int = -1
    """-1 or a rank of the job."""

    def validate(self, nprocs: int | None = None) -> None:
        super().validate(nprocs)
        config.at_least(self, 1, "steps", hint=" (one step or more)")
        config.positive(self, "lr")
        config.rank_or_none(self, "fail_rank", nprocs or 1)


def test_choices_come_from_the_type():
    assert config.choices(ToyConfig, "mode") == ("fast", "exact")
    assert config.choices(ToyConfig, "order") == (1, 2, None)
    assert config.choices(ToyConfig, "name") is None
    assert config.choices(ToyConfig, "steps") is None
    assert config.choices(HelloConfig, "backend") == ("auto", "gloo", "nccl")


def test_a_good_config_passes():
    ToyConfig().validate(2)
    ToyConfig(mode="exact", order=2, name="anything", fail_rank=1).validate(2)
    HelloConfig(backend="gloo").validate()


@pytest.mark.parametrize(
    "cfg, message",
    [
        (ToyConfig(mode="quick"), "mode='quick': must be one of 'fast', 'exact'."),
        (ToyConfig(order=3), "order=3: must be one of 1, 2, None."),
        (HelloConfig(backend="mpi"), "backend='mpi': must be one of 'auto', 'gloo', 'nccl'."),
    ],
)
def test_a_bad_choice_is_refused_naming_the_field(cfg, message):
    with pytest.raises(ValueError) as info:
        cfg.validate(2)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"steps": 0}, "steps=0: must be at least 1 (one step or more)."),
        ({"lr": float("nan")}, "lr=nan: must be a finite number."),
        ({"lr": 0.0}, "lr=0.0: must be positive."),
        ({"fail_rank": 2}, "fail_rank=2: must be -1 (none) or a rank of the job, 0 … 1 (2 ranks)."),
        ({"fail_rank": -2}, "fail_rank=-2: must be -1 (none)"),
    ],
)
def test_range_checks_name_the_field_its_value_and_the_rule(changes, message):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(ToyConfig(), **changes).validate(2)
    assert str(info.value).startswith(message)


def test_check_choices_works_on_any_dataclass():
    @dataclasses.dataclass
    class Plain:
        how: Literal["raise", "sigkill"] = "raise"

    config.check_choices(Plain())
    with pytest.raises(ValueError, match="how='segv'"):
        config.check_choices(Plain(how="segv"))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"steps": 2.5}, "steps=2.5 is a float: it must be an int (the default is 3)."),
        ({"steps": True}, "steps=True is a bool: it must be an int (the default is 3)."),
        ({"lr": "0.1"}, "lr='0.1' is a str: it must be a number (the default is 0.1)."),
        ({"name": None}, "name=None is a NoneType: it must be a str (the default is 'free')."),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_type(changes, message):
    with pytest.raises(TypeError) as info:
        dataclasses.replace(ToyConfig(), **changes).validate(2)
    assert str(info.value) == message
    dataclasses.replace(ToyConfig(), lr=1).validate(2)  # an int where a number is needed is fine


@pytest.mark.parametrize("seed", [-1, 2**31, 2**64, 1.5])
def test_a_seed_no_generator_takes_is_refused(seed):
    @dataclasses.dataclass(kw_only=True)
    class Seeded(config.Config):
        seed: float = 0  # typed loosely, so that the range check itself is what refuses 1.5

    with pytest.raises(ValueError, match=rf"seed={seed!r}: a seed must be an int from 0 to "):
        Seeded(seed=seed).validate(2)
    Seeded(seed=config.SEED_MAX).validate(2)
