"""The layout digest: which cache layout a hybrid key's bytes were written in.

Two instances may share an object only if they cut the KV cache the same way: same TP size,
same layers in each group, same page format. The digest is the interoperable definition
(vllm-ascend's hybrid keys use the same one, without pipeline stages): sha256 hex of
``json.dumps((tp_size, [(sorted(layer_names), signature), ...]), sort_keys=True)``, with
the namespace first when there is one. Signatures must be JSON: a ``repr`` fallback would
differ between processes. With pipeline parallelism each stage writes objects of its own
layers, under its own ``pp_rank`` in the key; the stages' layer ranges follow the TP size
in the payload.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from ._json_keys import refuse_coerced_keys


def layout_digest(
    tp_size: int,
    groups: Iterable[tuple[Iterable[str], object]],
    namespace: str | None = None,
    pp_stages: Sequence[tuple[int, int]] = (),
) -> str:
    """sha256 hex naming a cache layout; ``groups`` is ``(layer_names, signature)`` per group.

    Layer order within a group does not matter; group order, TP size, membership,
    signatures, namespace and the pipeline stages do. ``pp_stages``: the ``[start, end)``
    range of model layers each pipeline stage holds (empty: no pipeline stages).
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool):
        raise TypeError(f"tp_size must be an int, got {type(tp_size).__name__}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be positive, got {tp_size}")
    stages = [_stage(index, stage) for index, stage in enumerate(pp_stages)]
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
    described = []
    for index, (layer_names, signature) in enumerate(groups):
        if isinstance(layer_names, str):
            raise TypeError(f"groups[{index}]: layer_names must be a collection of str, not a str")
        names = list(layer_names)
        if not all(isinstance(name, str) for name in names):
            raise TypeError(f"groups[{index}]: every layer name must be a str: {names!r}")
        refuse_coerced_keys(signature, f"groups[{index}] signature")
        described.append((sorted(names), signature))
    parallel: tuple[object, ...] = (tp_size, stages) if stages else (tp_size,)
    payload = (*parallel, described)
    if namespace is not None:
        payload = (namespace, *payload)
    try:
        text = json.dumps(payload, sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"every group signature must be a JSON value: {exc}") from exc
    return hashlib.sha256(text.encode()).hexdigest()


def _stage(index: int, stage: object) -> list[int]:
    if (
        not isinstance(stage, tuple | list)
        or len(stage) != 2
        or not all(isinstance(end, int) and not isinstance(end, bool) for end in stage)
        or not 0 <= stage[0] <= stage[1]
    ):
        raise ValueError(f"pp_stages[{index}] must be a (start, end) layer range, got {stage!r}")
    return [stage[0], stage[1]]
