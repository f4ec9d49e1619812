"""Digests naming what a key's bytes are: the model's scope, a writer's topology.

`scope_digest` names the model's caches independent of parallelism: every topology of
one model computes it alike, so block hashes chained under it agree across topologies.
`topology_digest` adds one writer's cut (TP size, stage ranges): what a hybrid key's
`layout` field holds, since objects differ by topology where hashes do not.

`layout_digest` is the older name of a layout (TP, stages and per-rank signatures in one
hash), which hybridkv no longer writes; it stays the interoperable definition
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


def scope_digest(
    groups: Iterable[tuple[int, object]], num_layers: int, namespace: str | None = None
) -> str:
    """sha256 hex of a model's topology-free scope: ``groups`` is ``(vLLM group id,
    whole-model signature)`` per stored group, ``num_layers`` the model's layer count.

    No layer names: a pipeline stage's scheduler sees only its first stage's names, and
    every topology must compute the same scope. (vLLM groups the whole model's layers the
    same way whatever the stages, so the group ids and the layer count name them.)
    """
    _positive("num_layers", num_layers)
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
    described = []
    for index, (group_id, signature) in enumerate(groups):
        if not isinstance(group_id, int) or isinstance(group_id, bool) or group_id < 0:
            raise ValueError(f"groups[{index}]: group id must be an int >= 0, got {group_id!r}")
        refuse_coerced_keys(signature, f"groups[{index}] signature")
        described.append([group_id, signature])
    payload = {"scope": described, "layers": num_layers, "namespace": namespace}
    try:
        text = json.dumps(payload, sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"every group signature must be a JSON value: {exc}") from exc
    return hashlib.sha256(text.encode()).hexdigest()


def topology_digest(scope: str, tp_size: int, pp_stages: Sequence[tuple[int, int]] = ()) -> str:
    """sha256 hex of one writer topology of a scope: its TP size and the ``[start, end)``
    layer range of each pipeline stage (empty: one stage)."""
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a str, got {type(scope).__name__}")
    _positive("tp_size", tp_size)
    stages = [_stage(index, stage) for index, stage in enumerate(pp_stages)]
    payload = {"scope": scope, "tp": tp_size, "stages": stages}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
