"""The two Mooncake object key formats, their field rules and their parser.

Keys are built once per object and then compared, hashed and logged many times, so they are
frozen msgspec Structs checked in ``__post_init__``: a key that exists is well formed.
``parse_key`` only splits the text and converts numbers; the field rules it enforces are the
constructors' own, so the parser and the constructors cannot drift apart.
"""

from __future__ import annotations

import operator
import posixpath
import re
from collections.abc import Callable
from typing import Final

import msgspec

HYBRID_TAG: Final = "mooncake_hybrid_v1"
"""Version tag of the hybrid key format; a reader refuses any other version."""

MAX_FIELD_VALUE: Final = 2**63 - 1
"""Largest integer field value: keys stay readable by int64 tooling and parse back exactly."""

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
_LOWER_HEX = re.compile(r"[0-9a-f]+")
_ALPHANUMERIC = re.compile(r"[A-Za-z0-9]+")
_OTHER_VERSION = re.compile(r"mooncake_hybrid_[A-Za-z0-9_]*:")

_Order = tuple[str | int, ...]


class KeyFormatError(ValueError):
    """Text or a field value that does not make a valid key; ``field`` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        # Both arguments go to ValueError so the exception pickles across processes.
        super().__init__(field, problem)
        self.field = field
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}"


def _check_int(field: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}")
    if not minimum <= value <= MAX_FIELD_VALUE:
        raise KeyFormatError(field, f"must be in [{minimum}, 2**63), got {value}")


def _check_text(field: str, value: object, pattern: re.Pattern[str], rule: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")
    if pattern.fullmatch(value) is None:
        raise KeyFormatError(field, f"must be {rule}, got {value!r}")


def _check_model(value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"model must be a str, got {type(value).__name__}")
    if not value:
        raise KeyFormatError("model", "is empty")
    if "@" in value:
        raise KeyFormatError("model", f"contains '@', the key field separator: {value!r}")
    if "/" in value:
        raise KeyFormatError("model", f"contains '/'; pass it through model_name(): {value!r}")
    if not value.isprintable():
        raise KeyFormatError("model", f"contains a non-printable character: {value!r}")


def check_head(head: object) -> None:
    """The rule for the storing head/rank field, shared with the bulk renderer."""
    _check_int("head", head, 0)


def model_name(text: str) -> str:
    """The key's model field for a model as vLLM users name it (hub id or local path).

    Only the last path component is kept, for people reading keys: what tells two
    checkpoints of one name apart belongs in the block hash (the integration folds a
    fingerprint of the weights into it), so copies in other directories share; a path is
    normalised first, and one that names no directory by itself (`.`, `..`) is refused:
    every model given so would share one name.
    """
    if not isinstance(text, str):
        raise TypeError(f"model must be a str, got {type(text).__name__}")
    name = posixpath.normpath(text).rpartition("/")[2] if text else ""
    if name in (".", ".."):
        raise KeyFormatError(
            "model", f"{text!r} names no directory by itself; give the model's own path"
        )
    _check_model(name)
    return name


def _compare(order: Callable[[_Order, _Order], object]) -> Callable[[_Key, object], bool]:
    def compare(self: _Key, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, _Key):
            # Keys of different formats name different objects: no order between them.
            raise TypeError(f"cannot order {type(self).__name__} and {type(other).__name__}")
        return bool(order(self._order(), other._order()))

    return compare


class _Key(msgspec.Struct, frozen=True):
    """Ordering shared by both key types: by field, in rendering order."""

    def _order(self) -> _Order:
        raise NotImplementedError

    __lt__ = _compare(operator.lt)
    __le__ = _compare(operator.le)
    __gt__ = _compare(operator.gt)
    __ge__ = _compare(operator.ge)


class BlockKey(_Key, frozen=True, cache_hash=True):
    """The key of one block of a single-group model: ``{model}@{block_hash}@{head}``."""

    model: str
    block_hash: str
    head: int

    def __post_init__(self) -> None:
        _check_model(self.model)
        _check_text("block_hash", self.block_hash, _LOWER_HEX, "lowercase hex")
        check_head(self.head)

    @property
    def prefix(self) -> str:
        """Everything before the block hash: the same for every key of the model."""
        return f"{self.model}@"

    def _order(self) -> _Order:
        return (self.model, self.block_hash, self.head)

    def __str__(self) -> str:
        return f"{self.model}@{self.block_hash}@{self.head}"


class HybridKey(_Key, frozen=True, cache_hash=True):
    """The key of one block of one KV cache group of a hybrid model.

    ``{model}@mooncake_hybrid_v1:{layout}[@pp_rank:{pp_rank}]@group:{group}@block:{block_size}
    @{block_hash}@{head}``. The layout digest keeps instances with different cache layouts
    (TP size, grouping, page formats) from reading each other's bytes; ``block_size`` is the
    number of raw tokens one block of the group covers.
    """

    model: str
    layout: str
    group: int
    block_size: int
    block_hash: str
    head: int
    pp_rank: int | None = None

    def __post_init__(self) -> None:
        _check_model(self.model)
        _check_text("layout", self.layout, _ALPHANUMERIC, "an alphanumeric token")
        if self.pp_rank is not None:
            _check_int("pp_rank", self.pp_rank, 0)
        _check_int("group", self.group, 0)
        _check_int("block_size", self.block_size, 1)
        _check_text("block_hash", self.block_hash, _LOWER_HEX, "lowercase hex")
        check_head(self.head)

    @property
    def prefix(self) -> str:
        """Everything before the block hash: the same for every key of the group."""
        pp = "" if self.pp_rank is None else f"@pp_rank:{self.pp_rank}"
        return (
            f"{self.model}@{HYBRID_TAG}:{self.layout}{pp}"
            f"@group:{self.group}@block:{self.block_size}@"
        )

    def _order(self) -> _Order:
        pp_rank = -1 if self.pp_rank is None else self.pp_rank
        return (
            self.model,
            self.layout,
            pp_rank,
            self.group,
            self.block_size,
            self.block_hash,
            self.head,
        )

    def __str__(self) -> str:
        return f"{self.prefix}{self.block_hash}@{self.head}"


def _decimal(field: str, text: str) -> int:
    if _DECIMAL.fullmatch(text) is None:
        raise KeyFormatError(field, f"must be a decimal integer without sign or padding: {text!r}")
    return int(text)


def _labelled(field: str, label: str, text: str) -> int:
    if not text.startswith(f"{label}:"):
        raise KeyFormatError(field, f"expected '{label}:<integer>', got {text!r}")
    return _decimal(field, text[len(label) + 1 :])


def _parse_hybrid(parts: list[str]) -> HybridKey:
    model, versioned_layout, *rest = parts
    layout = versioned_layout[len(HYBRID_TAG) + 1 :]
    pp_rank = None
    if rest and rest[0].startswith("pp_rank"):
        pp_rank = _labelled("pp_rank", "pp_rank", rest.pop(0))
    if len(rest) != 4:
        expected = 6 if pp_rank is None else 7
        raise KeyFormatError(
            "key", f"a {HYBRID_TAG} key has {expected} '@'-separated fields, got {len(parts)}"
        )
    group, block_size, block_hash, head = rest
    return HybridKey(
        model=model,
        layout=layout,
        group=_labelled("group", "group", group),
        block_size=_labelled("block_size", "block", block_size),
        block_hash=block_hash,
        head=_decimal("head", head),
        pp_rank=pp_rank,
    )


def parse_key(text: str) -> BlockKey | HybridKey:
    """The key ``text`` spells; anything else raises KeyFormatError naming the bad field."""
    if not isinstance(text, str):
        raise TypeError(f"key must be a str, got {type(text).__name__}")
    parts = text.split("@")
    if len(parts) > 1 and parts[1].startswith(f"{HYBRID_TAG}:"):
        return _parse_hybrid(parts)
    if len(parts) > 1 and _OTHER_VERSION.match(parts[1]):
        version = parts[1].partition(":")[0]
        raise KeyFormatError("version", f"unknown key format {version!r}; expected {HYBRID_TAG}")
    if len(parts) != 3:
        raise KeyFormatError(
            "key",
            f"expected '{{model}}@{{block_hash}}@{{head}}' or a {HYBRID_TAG} key, "
            f"got {len(parts)} '@'-separated fields",
        )
    model, block_hash, head = parts
    return BlockKey(model=model, block_hash=block_hash, head=_decimal("head", head))
