"""The bounded set of prefixes known fresh against an ordered-dict oracle."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.integration.fresh_prefixes import FreshPrefixes

_ops = st.lists(st.tuples(st.sampled_from(["add", "holds", "clear"]), st.binary(max_size=1)))


@given(capacity=st.integers(1, 4), ops=_ops)
def test_least_recently_used_prefixes_leave_first(
    capacity: int, ops: list[tuple[str, bytes]]
) -> None:
    fresh = FreshPrefixes(capacity)
    oracle: OrderedDict[bytes, None] = OrderedDict()
    for op, prefix in ops:
        if op == "clear":
            fresh.clear()
            oracle.clear()
        elif op == "add" or prefix in oracle:
            held = prefix in oracle
            oracle[prefix] = None
            oracle.move_to_end(prefix)
            if len(oracle) > capacity:
                oracle.popitem(last=False)
            if op == "add":
                fresh.add(prefix)
            else:
                assert fresh.holds(prefix) is held
        else:
            assert fresh.holds(prefix) is False
        assert len(fresh) == len(oracle)
    assert all(fresh.holds(prefix) for prefix in list(oracle))


def test_a_capacity_that_holds_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity must be positive, got 0"):
        FreshPrefixes(0)
