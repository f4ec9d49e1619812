"""The quarantine of failed keys against a model that remembers every failure."""

from __future__ import annotations

import pytest
from conftest import Clock
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.integration.quarantine import Quarantine

KEYS = st.sampled_from(["a", "b", "c", "d"])
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(KEYS, max_size=3)),
        st.tuples(st.just("wait"), st.floats(0, 20)),
    ),
    max_size=30,
)


@given(STEPS)
def test_a_key_is_held_until_its_last_failure_is_older_than_the_quarantine(
    steps: list[tuple[str, object]],
) -> None:
    clock = Clock()
    quarantine = Quarantine(10.0, clock)
    failed_at: dict[str, float] = {}
    for action, value in steps:
        if action == "add":
            assert isinstance(value, list)
            was_held = {key for key, at in failed_at.items() if clock.now < at + 10.0}
            assert quarantine.add(value) == len(set(value) - was_held)
            failed_at.update(dict.fromkeys(value, clock.now))
        else:
            assert isinstance(value, float)
            clock.now += value
        held = {key for key, at in failed_at.items() if clock.now < at + 10.0}
        holding = quarantine.holding(list("abcd"))
        assert {key for key, out in zip("abcd", holding, strict=True) if out} == held
        assert len(quarantine) == len(held)


@pytest.mark.parametrize("seconds", [0, -1])
def test_a_quarantine_must_last(seconds: float) -> None:
    with pytest.raises(ValueError, match="positive time"):
        Quarantine(seconds)
