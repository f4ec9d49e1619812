"""JSON values that hash apart: refuse what `json.dumps` would silently merge."""

from __future__ import annotations


def refuse_coerced_keys(value: object, path: str) -> None:
    """JSON turns every dict key into a string, so ``{1: x}`` would hash as ``{"1": x}``.

    `path` names `value` in the error (e.g. ``extra``). A container met again inside
    itself is circular: left to `json.dumps`, which says so.
    """
    _walk(value, path, set())


def _walk(value: object, path: str, open_containers: set[int]) -> None:
    if not isinstance(value, (dict, list, tuple)) or id(value) in open_containers:
        return
    open_containers.add(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{path}: dict key {key!r} ({type(key).__name__}) is not a str; "
                    "JSON would turn it into a string and collide with that string key"
                )
            _walk(item, f"{path}[{key!r}]", open_containers)
    else:
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", open_containers)
    open_containers.discard(id(value))
