"""Mooncake's integer codes become statuses and exceptions that say what happened."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.transport.errors import (
    InvalidRequestError,
    NoSpaceError,
    NotFoundError,
    Status,
    StoreError,
    StoreUnavailable,
    TransferError,
    raise_on_failure,
)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (0, Status.OK),
        (4096, Status.OK),  # reads report the bytes they moved
        (-200, Status.NO_SPACE),
        (-600, Status.INVALID),
        (-702, Status.INVALID),
        (-703, Status.NOT_READY),
        (-704, Status.NOT_FOUND),
        (-705, Status.EXISTS),
        (-706, Status.LEASED),
        (-800, Status.TRANSFER_FAILED),
        (-900, Status.RPC_FAILED),
        (-1, Status.OTHER),
    ],
)
def test_codes_seen_from_mooncake_map_to_their_meaning(code: int, status: Status) -> None:
    assert Status.from_code(code) is status


@given(st.integers(-(2**31), 2**31 - 1))
def test_every_code_maps_to_some_status(code: int) -> None:
    status = Status.from_code(code)
    assert status.ok == (code >= 0)


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (Status.NO_SPACE, NoSpaceError),
        (Status.INVALID, InvalidRequestError),
        (Status.NOT_FOUND, NotFoundError),
        (Status.NOT_READY, NotFoundError),
        (Status.TRANSFER_FAILED, TransferError),
        (Status.RPC_FAILED, StoreUnavailable),
        (Status.LEASED, StoreError),
    ],
)
def test_raise_on_failure_names_key_operation_and_status(
    status: Status, error: type[StoreError]
) -> None:
    raise_on_failure("get", ["a"], [Status.OK])
    with pytest.raises(error, match=rf"get of 'b' failed: {status.name} \({status.value}\)"):
        raise_on_failure("get", ["a", "b"], [Status.OK, status])
