"""A block whose load before the forward failed, shared through vLLM's prefix cache:
nothing computed over it reaches the pool before it is computed again.

vLLM 0.32 (`kv_load_failure_policy: recompute`) rolls back only the first running request
holding a failed block; the others sharing it wait for that one's recompute, and one
admitted before the failure was known (async scheduling) keeps what it computed over it.
The real scheduler and worker sides (whole blocks, the transfer engine, the in-memory
store) run vLLM's sequence of calls around a stand-in forward: a block's KV is right
(its index + 1) only if every block below it in the writer's table was right when it was
written, else garbage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import attention, groups, request, require, scheduler_output

from hybridkv.integration.cache_layouts import build_layouts
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.metadata import BlockRef, HybridKVMetadata, RequestTransfers
from hybridkv.integration.scheduler import SchedulerSide
from hybridkv.integration.transfer_strategy import WholeBlocks
from hybridkv.integration.worker import WorkerSide
from hybridkv.transport import CpuEvent, MemoryStore, TransferEngine

torch = require("torch")
SIZE = 32
NUM_BLOCKS = 24
GARBAGE = -7.0
SCRATCH = 23  # a block the final check loads into
TOKENS = list(range(100, 300))  # A's prompt: 6 full blocks + 8 tokens
PREFIX = TOKENS[:192]


class Rig:
    def __init__(self, specs: Any, steps_ahead: int) -> None:
        plan = plan_groups(groups(specs, (["a"], attention(specs))), [0], ModelShape(1, 2))
        self.keys = KeySpace(plan, "tiny")
        self.cache = torch.zeros(NUM_BLOCKS, 2, SIZE, 2, 64)
        layouts = build_layouts(self.keys, {"a": self.cache}, {"a": 0}, NUM_BLOCKS)
        self.store = MemoryStore()
        engine = TransferEngine(self.store, layouts)
        self.worker = WorkerSide(
            self.keys, engine, WholeBlocks(engine, CpuEvent), 0, CpuEvent, steps_ahead=steps_ahead
        )
        self.side = SchedulerSide(
            self.keys, ConnectorConfig(), self.store.batch_is_readable, steps_ahead=steps_ahead
        )
        hashes = RequestHashes(plan, "", None, 0)
        hashes.cover(PREFIX, len(PREFIX))
        self.hashes = hashes.for_group(SIZE)[:6]  # the shared prefix's blocks 0-5

    def key(self, index: int) -> str:
        return self.keys.keys(0, [self.hashes[index]], [0])[0]

    # -- vLLM's forward, as far as KV goes ------------------------------------------------

    def right(self, block_id: int, index: int) -> bool:
        return bool((self.cache[block_id] == float(index + 1)).all())

    def forward(self, tables: dict[str, list[int]], spans: dict[str, tuple[int, int]]) -> None:
        """All requests of a step write a layer's KV before any attends: a request's block
        is right if every block below it is right once the step's other writes landed."""
        for _ in range(3):  # to a fixpoint
            for rid, (start, done) in spans.items():
                ids = tables[rid]
                for b in range(start // SIZE, -(-done // SIZE)):
                    ok = all(self.right(ids[i], i) for i in range(b))
                    if start % SIZE and b == start // SIZE:
                        ok = ok and self.right(ids[b], b)  # its first part, written before
                    self.cache[ids[b]] = float(b + 1) if ok and b < 6 else GARBAGE
                    if ok and b >= 6:  # past the shared prefix: "right" = a marker
                        self.cache[ids[b]] = float(b + 1)

    # -- worker -----------------------------------------------------------------------------

    def run(self, meta: HybridKVMetadata, tables: dict, spans: dict) -> None:
        """begin_step .. wait_for_save, then the next step's first hook."""
        self.worker.begin_step(meta)
        self.worker.start_async_loads()
        self.worker.settle_loads()  # the loads land before the forward
        self.forward(tables, spans)
        self.worker.end_step()
        self.worker.barrier()

    def report(self) -> set[int]:
        """vLLM's update_from_output -> the connector's update_connector_output."""
        invalid = self.worker.take_load_errors()
        keys, unsaved = self.worker.take_failed_keys(), self.worker.take_unsaved()
        self.side.loads_failed((), keys, unsaved, invalid)  # as KVConnectorOutput has them
        return invalid

    def stored_wrong(self, indexes: range) -> list[int]:
        """Blocks of the shared prefix the pool holds with other KV than the right one."""
        wrong = []
        for index in indexes:
            if not self.store.batch_is_readable([self.key(index)])[0]:
                continue
            load = BlockRef(0, index, SCRATCH, self.hashes[index])
            self.cache[SCRATCH] = 0
            self.run(HybridKVMetadata([RequestTransfers(request_id="check", loads=[load])]), {}, {})
            if not self.right(SCRATCH, index):
                wrong.append(index)
        return wrong


@pytest.fixture
def rigs(vllm_specs: Any) -> Iterator[Callable[[int], Rig]]:
    """`Rig`s with `steps_ahead`, their workers closed after the test."""
    made: list[Rig] = []

    def make(steps_ahead: int) -> Rig:
        made.append(Rig(vllm_specs, steps_ahead))
        return made[-1]

    yield make
    for rig in made:
        rig.worker.close()


def _seed_and_fail_a(rig: Rig) -> tuple[Any, list[int]]:
    """Another instance stored blocks 0-2; A hits them, block 1 (X) is evicted before A
    reads it. Returns A and its table."""
    side = rig.side
    p = request("p", TOKENS[:100])
    assert side.num_new_matched_tokens(p, 0) == (0, False)
    side.after_alloc(p, ([1, 2, 3, 4],), 0)
    meta = side.build_meta(scheduler_output(new=[("p", ([1, 2, 3, 4],), 0, 100)]))
    rig.run(meta, {"p": [1, 2, 3, 4]}, {"p": (0, 100)})
    rig.report()
    side.build_meta(scheduler_output(finished={"p"}))  # (nothing scheduled)
    assert rig.stored_wrong(range(3)) == []
    rig.cache.zero_()
    a = request("a", TOKENS)
    assert side.num_new_matched_tokens(a, 0) == (96, False)
    rig.store.batch_remove([rig.key(1)], force=True)  # evicted after the lookup
    table_a = [5, 6, 7, 8, 9, 10, 11]
    side.after_alloc(a, (table_a,), 96)
    return a, table_a


def _saves_admitting(
    rig: Rig, newcomer: Any, table: list[int], local_hit: int, running: Any
) -> set[tuple[int, int]]:
    """(block index, block id) of the saves planned in the step that admits `newcomer`,
    hitting `local_hit` tokens in vLLM's prefix cache, while `running` decodes a token."""
    side = rig.side
    assert side.num_new_matched_tokens(newcomer, local_hit) == (0, False)
    side.after_alloc(newcomer, (table,), 0)
    running.all_token_ids = [*running.all_token_ids, 0]
    running.num_tokens += 1
    out = scheduler_output(
        cached=[(running.request_id, running.num_tokens - 1, 1)],
        new=[(newcomer.request_id, (table,), local_hit, newcomer.num_tokens - local_hit)],
    )
    return _saved(side.build_meta(out))


def _saved(meta: HybridKVMetadata) -> set[tuple[int, int]]:
    """(block index, block id) of every save `meta` plans."""
    return {(ref.index, ref.block_id) for t in meta.requests for ref in t.saves}


@pytest.mark.parametrize("case", ["a_recomputes_all", "a_aborted", "a_chunk_capped"])
def test_a_request_sharing_a_failed_block_saves_nothing_over_it_before_it_is_redone(
    rigs: Callable[[int], Rig], case: str
) -> None:
    """Synchronous scheduling: B shares A's blocks, A's load of block 1 fails, vLLM rolls
    A back and B only to the tokens it had. B saves nothing of those blocks before A has
    computed them again (A may be cancelled, or its chunk cut short)."""
    rig = rigs(0)
    side = rig.side
    _, table_a = _seed_and_fail_a(rig)
    # B, admitted in the same step, hits A's blocks 0-5 in vLLM's prefix cache (cached at
    # A's allocation): vLLM computes its last 20 tokens.
    b = request("b", PREFIX + list(range(900, 920)))
    assert side.num_new_matched_tokens(b, 192) == (0, False)
    table_b = [*table_a[:6], 12]
    side.after_alloc(b, (table_b,), 0)
    tables = {"a": table_a, "b": table_b}
    out = scheduler_output(new=[("a", (table_a,), 96, 104), ("b", (table_b,), 192, 20)])
    rig.run(side.build_meta(out), tables, {"a": (96, 200), "b": (192, 212)})
    assert rig.report() == {6}  # X's block id
    # vLLM (kv_load_failure_policy=recompute): A back to 32 tokens (it marks X), B back to
    # its 192 (X "will be recomputed by A"); X stays in vLLM's prefix cache.
    if case == "a_aborted":  # the client cancels A before it recomputes X
        out = scheduler_output(cached=[("b", 192, 20)], finished={"a"})
        spans = {"b": (192, 212)}
    elif case == "a_recomputes_all":  # control: passes on the current code
        out = scheduler_output(cached=[("a", 32, 168), ("b", 192, 20)])
        spans = {"a": (32, 200), "b": (192, 212)}
    else:  # long_prefill_token_threshold=32: A recomputes X only, B runs
        out = scheduler_output(cached=[("a", 32, 32), ("b", 192, 20)])
        spans = {"a": (32, 64), "b": (192, 212)}
    meta = side.build_meta(out)
    rig.run(meta, tables, spans)
    rig.report()
    assert rig.stored_wrong(range(6)) == []
    if case == "a_recomputes_all":  # and what A computed again is saved at once
        keys = [rig.key(i) for i in range(6)]
        assert rig.store.batch_is_readable(keys) == [True] * 6
    if case == "a_chunk_capped":  # A recomputes the rest: every block is saved, right
        b.all_token_ids = [*b.all_token_ids, 1]
        b.num_tokens = 213
        out = scheduler_output(cached=[("a", 64, 136), ("b", 212, 1)])
        rig.run(side.build_meta(out), tables, {"a": (64, 200), "b": (212, 213)})
        rig.report()
        keys = [rig.key(i) for i in range(6)]
        assert rig.store.batch_is_readable(keys) == [True] * 6
        assert rig.stored_wrong(range(6)) == []


def test_blocks_a_request_computed_over_a_failed_block_before_it_was_known_are_not_saved(
    rigs: Callable[[int], Rig],
) -> None:
    """Async scheduling: D is admitted in step N+1, scheduled before vLLM learnt of step N's
    failure, over X. vLLM's _update_requests_with_invalid_blocks subtracts step N's
    scheduled tokens (none of D's): D keeps its N+1 progress, computed over garbage. Its
    left-out saves come back as `unsaved`; planned again, they are never saved."""
    rig = rigs(1)
    side = rig.side
    a, table_a = _seed_and_fail_a(rig)
    out_n = scheduler_output(new=[("a", (table_a,), 96, 104)])
    meta_n = side.build_meta(out_n)
    d = request("d", PREFIX + list(range(900, 964)))  # 256 tokens
    assert side.num_new_matched_tokens(d, 192) == (0, False)
    table_d = [*table_a[:6], 12, 13, 14]
    side.after_alloc(d, (table_d,), 0)
    a.all_token_ids = [*TOKENS, 5]
    a.num_tokens = 201
    out_n1 = scheduler_output(cached=[("a", 200, 1)], new=[("d", (table_d,), 192, 64)])
    meta_n1 = side.build_meta(out_n1)  # scheduled before step N's output
    tables = {"a": table_a, "d": table_d}
    rig.run(meta_n, tables, {"a": (96, 200)})
    assert rig.report() == {6}  # update_from_output(N): A -> 32, D keeps 256
    rig.run(meta_n1, tables, {"a": (200, 201), "d": (192, 256)})
    d.all_token_ids = [*d.all_token_ids, 7]
    d.num_tokens = 257
    meta_n2 = side.build_meta(scheduler_output(cached=[("a", 32, 169), ("d", 256, 1)]))
    rig.report()  # update_from_output(N+1): D's left-out saves come back
    rig.run(meta_n2, tables, {"a": (32, 201), "d": (256, 257)})  # A recomputes X..5
    d.all_token_ids = [*d.all_token_ids, 8]
    d.num_tokens = 258
    meta_n3 = side.build_meta(scheduler_output(cached=[("a", 201, 1), ("d", 257, 1)]))
    rig.report()
    saved = _saved(meta_n3)
    # D's blocks 6-7 were computed in N+1 over the garbage X and are never recomputed
    # (vLLM did not roll D back): saving them publishes garbage under their right keys.
    garbage = {(i, table_d[i]) for i in (6, 7) if not rig.right(table_d[i], i)}
    assert garbage == {(6, 12), (7, 13)}
    assert not (saved & garbage), saved
    rig.run(meta_n3, tables, {"a": (201, 202), "d": (257, 258)})


def test_blocks_of_a_request_gone_before_the_failure_was_known_stay_unsaved(
    rigs: Callable[[int], Rig],
) -> None:
    """Async scheduling: D, admitted blind in step N+1 over X, is cancelled before vLLM
    processes step N's output (vLLM forgets it in the connector at once). What D computed
    over X stays in vLLM's prefix cache: F, hitting D's blocks there later, saves none of
    them."""
    rig = rigs(1)
    side = rig.side
    a, table_a = _seed_and_fail_a(rig)
    meta_n = side.build_meta(scheduler_output(new=[("a", (table_a,), 96, 104)]))
    tail_d = list(range(900, 964))
    d = request("d", PREFIX + tail_d)  # 256 tokens
    assert side.num_new_matched_tokens(d, 192) == (0, False)
    table_d = [*table_a[:6], 12, 13]
    side.after_alloc(d, (table_d,), 0)
    a.all_token_ids = [*TOKENS, 5]
    a.num_tokens = 201
    out_n1 = scheduler_output(cached=[("a", 200, 1)], new=[("d", (table_d,), 192, 64)])
    meta_n1 = side.build_meta(out_n1)
    tables = {"a": table_a, "d": table_d}
    rig.run(meta_n, tables, {"a": (96, 200)})
    side.forget("d")  # the client cancels D: vLLM frees it before processing step N
    assert rig.report() == {6}
    rig.run(meta_n1, tables, {"a": (200, 201), "d": (192, 256)})
    rig.report()
    meta_n2 = side.build_meta(scheduler_output(cached=[("a", 32, 169)], finished={"d"}))
    rig.run(meta_n2, tables, {"a": (32, 201)})  # A computes X and its blocks again
    rig.report()
    garbage = {(i, table_d[i]) for i in (6, 7) if not rig.right(table_d[i], i)}
    assert garbage == {(6, 12), (7, 13)}
    f = request("f", [*PREFIX, *tail_d, *range(700, 720)])  # hits D's 256 tokens locally
    saved = _saves_admitting(rig, f, [*table_d, 14], 256, a)
    assert not (saved & garbage), saved


def test_blocks_computed_over_a_failed_block_by_a_request_gone_a_step_before_its_report(
    rigs: Callable[[int], Rig],
) -> None:
    """Async scheduling: A computes over X in step N and is cancelled before step N+1 is
    scheduled; only step N's table shows A's blocks after X. B, sharing only X, is rolled
    back and computes X again right; E, hitting A's blocks in vLLM's prefix cache, saves
    none of the garbage A left after X."""
    rig = rigs(1)
    side = rig.side
    _, table_a = _seed_and_fail_a(rig)
    b = request("b", [*PREFIX[:64], *range(900, 940)])  # 104 tokens: shares blocks 0-1
    assert side.num_new_matched_tokens(b, 64) == (0, False)
    table_b = [*table_a[:2], 12, 13]
    side.after_alloc(b, (table_b,), 0)
    out_n = scheduler_output(new=[("a", (table_a,), 96, 104), ("b", (table_b,), 64, 40)])
    meta_n = side.build_meta(out_n)
    side.forget("a")  # the client cancels A: vLLM frees it before scheduling step N+1
    b.all_token_ids = [*b.all_token_ids, 1]
    b.num_tokens = 105
    meta_n1 = side.build_meta(scheduler_output(cached=[("b", 104, 1)], finished={"a"}))
    tables = {"a": table_a, "b": table_b}
    rig.run(meta_n, tables, {"a": (96, 200), "b": (64, 104)})
    assert rig.report() == {6}  # update_from_output(N): B back to 32 (A is gone)
    rig.run(meta_n1, tables, {"b": (104, 105)})
    meta_n2 = side.build_meta(scheduler_output(cached=[("b", 32, 73)]))
    rig.report()
    rig.run(meta_n2, tables, {"b": (32, 105)})  # B computes X and its blocks again
    rig.report()
    assert rig.right(table_a[1], 1)  # X is right again; A's blocks after it are not
    garbage = {(i, table_a[i]) for i in range(2, 6) if not rig.right(table_a[i], i)}
    assert garbage == {(i, table_a[i]) for i in range(3, 6)}  # (block 2 loaded right)
    e = request("e", TOKENS)  # A's prompt: hits A's 192 tokens in vLLM's prefix cache
    saved = _saves_admitting(rig, e, [*table_a[:6], 14], 192, b)
    assert not (saved & garbage), saved
    assert rig.stored_wrong(range(6)) == []


def test_a_preempted_request_s_freed_blocks_are_not_taken_for_its_own(
    rigs: Callable[[int], Rig],
) -> None:
    """O ran and was preempted (vLLM tells the connector nothing); A's failed load lands
    in a block O freed, Q computes in another. Nothing was computed over the failed block
    in Q's table: Q's block is saved once the step is over."""
    rig = rigs(0)
    side = rig.side
    old = request("o", list(range(3000, 3128)))
    assert side.num_new_matched_tokens(old, 0) == (0, False)
    table_o = [15, 16, 6, 17]
    side.after_alloc(old, (table_o,), 0)
    rig.run(
        side.build_meta(scheduler_output(new=[("o", (table_o,), 0, 128)])),
        {"o": table_o},
        {"o": (0, 128)},
    )
    rig.report()  # O is preempted: its blocks go back to vLLM's free queue
    _, table_a = _seed_and_fail_a(rig)  # A's block 1 lands in block 6
    q_tokens = list(range(4000, 4040))
    q = request("q", q_tokens)
    assert side.num_new_matched_tokens(q, 0) == (0, False)
    table_q = [17, 18]  # O's last block
    side.after_alloc(q, (table_q,), 0)
    out = scheduler_output(new=[("a", (table_a,), 96, 104), ("q", (table_q,), 0, 40)])
    tables = {"a": table_a, "q": table_q}
    rig.run(side.build_meta(out), tables, {"a": (96, 200), "q": (0, 40)})
    assert rig.report() == {6}  # Q's save of its block 0 went back to the scheduler
    q.all_token_ids = [*q_tokens, 1]
    q.num_tokens = 41
    out = scheduler_output(cached=[("a", 32, 168), ("q", 40, 1)])
    saved = {(t.request_id, ref.index) for t in side.build_meta(out).requests for ref in t.saves}
    assert ("q", 0) in saved
