"""Lookup time vs prompt length: the boundary search beside today's all-keys query.

A real `mooncake_master` holds `--objects` tiny objects (16 bytes each, put in batches into
one segment holder): filler keys plus, for each row, the first half of its prompt (at most
`--held` tokens), every group's and every storing head's objects. A row is a prompt of N
tokens in 16-token blocks, G full-attention groups and TP T (T storing KV heads); the
lookup is the scheduler's own path: `SchedulerSide.num_new_matched_tokens` sends block
hashes over the lookup socket (`LookupClient` to `LookupServer` on a loopback port), the
server renders their keys (`KeySpace`) and asks the master (`MooncakeStore.batch_is_readable`);
"KB" columns are the requests' bytes, beside what the all-keys lookup sent as rendered
keys before hashes went instead. Both
lookups run in the same process against the same master, alternating; "all keys" is
today's one query about every storing head of every block of every group (the connector
still asks so below 2048 keys), "search" the coordinator's `HitSearch`.
Times are the median of `--repeats` re-asks of one waiting request, the two kinds in
turn (vLLM asks again each step while a request waits; its block hashes are computed
once, at its first ask, a search timed apart as "first ask": it hashes N tokens and makes
the request's store mask, each also timed alone as "hash" and "mask"). Every
lookup's hit is checked: both find the held half.

Run: `python benchmarks/bench_lookup.py [--objects 1000000] [--lengths 4096 32768 131072
1048576] [--tp 1 8] [--groups 1 4] [--repeats 5]`; needs vLLM (its KV cache spec classes)
and mooncake installed. Filling a million objects takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.lookup import LookupClient, LookupServer
from hybridkv.integration.lookup.wire import lookup_payloads
from hybridkv.integration.scheduler import SchedulerSide
from hybridkv.transport import MasterProcess, MooncakeConfig, MooncakeStore, SegmentHolder

BLOCK = 16
OBJECT_BYTES = 16
PUT_BATCH = 4096
# The holder's segment per object: Mooncake's allocator rounds small objects up.
SEGMENT_PER_OBJECT = 256
HEAD_DIM = 64


class Row:
    """One prompt shape: its scheduler side, its request and the hit it should find."""

    def __init__(self, tokens: int, tp: int, groups: int, held: int) -> None:
        import torch
        from vllm.v1 import kv_cache_interface as specs

        spec = specs.FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=tp, head_size=HEAD_DIM, dtype=torch.float16
        )
        kv_groups = [
            specs.KVCacheGroupSpec(layer_names=[f"layers.{g}"], kv_cache_spec=spec)
            for g in range(groups)
        ]
        plan = plan_groups(kv_groups, list(range(groups)), ModelShape(tp, tp))
        self.label = f"{tokens:>9,} tokens  TP{tp}  {groups} groups"
        self.keys = KeySpace(plan, f"bench-lookup-{tokens}-{tp}-{groups}")
        self.prompt = list(range(7, 7 + tokens))
        self.held = min(tokens // 2, held) // BLOCK * BLOCK
        self.exact_keys = tokens // BLOCK * groups * tp

    def connect(self, client: LookupClient) -> None:
        """Look up through `client`, by block hashes (the server renders the keys)."""
        self.client = client
        # Re-asks measure the pool query: none is answered from the answer memory.
        config = ConnectorConfig(lookup_memory_s=0)
        self.side = SchedulerSide(self.keys, config, client.query, block_query=client.query_blocks)

    def held_keys(self) -> list[str]:
        return self.prompt_keys(self.held)

    def prompt_keys(self, tokens: int) -> list[str]:
        """Every group's and storing head's keys of the first `tokens` tokens."""
        hashes = RequestHashes(self.keys.plan, "", None)
        hashes.cover(self.prompt, tokens)
        blocks = hashes.for_group(BLOCK)[: tokens // BLOCK]
        return [
            key
            for group, plan in enumerate(self.keys.plan.groups)
            for key in self.keys.keys(group, blocks, plan.heads.heads)
        ]

    def keyed_bytes(self) -> int:
        """What today's all-keys lookup sent as rendered keys, before hashes went instead."""
        top = (len(self.prompt) - 1) // BLOCK * BLOCK
        return sum(len(payload) for _, payload in lookup_payloads(self.prompt_keys(top)))

    def request(self, request_id: str) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(
            request_id=request_id,
            num_tokens=len(self.prompt),
            num_prompt_tokens=len(self.prompt),
            num_computed_tokens=0,
            all_token_ids=self.prompt,
            prompt_embeds=None,
            lora_request=None,
            cache_salt=None,
            mm_features=[],
        )


def fill(store: MooncakeStore, keys: Sequence[str]) -> None:
    """Put `keys` as tiny objects, `PUT_BATCH` a call, from one registered buffer."""
    buffer = np.full(OBJECT_BYTES * PUT_BATCH, 7, dtype=np.uint8)
    store.register_buffer(buffer.ctypes.data, buffer.nbytes)
    base = buffer.ctypes.data
    try:
        for start in range(0, len(keys), PUT_BATCH):
            batch = keys[start : start + PUT_BATCH]
            ptrs = [[base + i * OBJECT_BYTES] for i in range(len(batch))]
            sizes = [[OBJECT_BYTES]] * len(batch)
            statuses = store.batch_put_whole(batch, ptrs, sizes)
            failed = [s for s in statuses if s.name != "OK"]
            if failed:
                raise RuntimeError(f"fill: {len(failed)} puts failed ({failed[0]}) at {start}")
    finally:
        store.unregister_buffer(base)


def exact(row: Row, on: bool) -> None:
    """Today's lookup (every key in one query) or the search."""
    row.side._hits.exact_keys = sys.maxsize if on else DEFAULT_EXACT


DEFAULT_EXACT = ConnectorConfig().test_exact_lookup_keys


def timed_lookup(row: Row, request: Any) -> tuple[float, int, int]:
    """Seconds of one lookup, its hit in tokens and the bytes it sent."""
    sent = row.client.sent_bytes
    start = time.perf_counter()
    hit, _ = row.side.num_new_matched_tokens(request, 0)
    return time.perf_counter() - start, hit, row.client.sent_bytes - sent


def measure(row: Row, repeats: int) -> dict[str, float]:
    """Median seconds per lookup of each kind, the two alternating on one waiting request,
    and its first ask (a search, hashing the prompt)."""
    request = row.request("waiting")
    start = time.perf_counter()
    RequestHashes(row.keys.plan, "", request).cover(row.prompt, len(row.prompt))
    hashing = time.perf_counter() - start
    start = time.perf_counter()
    row.side.coordinator.store_mask(len(row.prompt))
    masking = time.perf_counter() - start
    exact(row, False)
    seconds, hit, _ = timed_lookup(row, request)
    check(row, hit, "first ask")
    times: dict[str, list[float]] = {
        "all keys": [],
        "search": [],
        "first ask": [seconds],
        "hash": [hashing],
        "store mask": [masking],
        "all keys bytes": [],
        "search bytes": [],
    }
    for repeat in range(repeats):
        kinds = ["all keys", "search"] if repeat % 2 else ["search", "all keys"]
        for kind in kinds:
            exact(row, kind == "all keys")
            seconds, hit, sent = timed_lookup(row, request)
            check(row, hit, kind)
            times[kind].append(seconds)
            times[f"{kind} bytes"].append(sent)
    exact(row, False)
    return {kind: statistics.median(values) for kind, values in times.items()}


def serve(row: Row, store: MooncakeStore, repeats: int) -> dict[str, float]:
    """`measure` through a lookup server of the row's key space, as worker rank 0's."""
    server = LookupServer(store.batch_is_readable, keys=row.keys)
    client = LookupClient(server.address, timeout_ms=60_000)
    try:
        row.connect(client)
        return measure(row, repeats)
    finally:
        client.close()
        server.close()


def check(row: Row, hit: int, kind: str) -> None:
    if hit != row.held:
        raise AssertionError(f"{row.label}: {kind} found {hit} tokens, the pool holds {row.held}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072, 1 << 20])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--held", type=int, default=32768, help="tokens held per prompt, at most")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

    segment = max(args.objects, 1) * SEGMENT_PER_OBJECT + (256 << 20)
    with MasterProcess.start() as master, SegmentHolder.start(master.address, segment):
        store = MooncakeStore.connect(
            MooncakeConfig(
                master_server_address=master.address,
                global_segment_size=0,
                local_buffer_size=64 << 20,
            )
        )
        try:
            rows = [
                Row(tokens, tp, groups, args.held)
                for tokens in args.lengths
                for tp in args.tp
                for groups in args.groups
            ]
            held = [key for row in rows for key in row.held_keys()]
            filler = [f"bench-lookup-filler-{i}" for i in range(max(0, args.objects - len(held)))]
            start = time.perf_counter()
            fill(store, held + filler)
            seconds = time.perf_counter() - start
            total = len(held) + len(filler)
            print(
                f"bench_lookup: master holds {total:,} objects of {OBJECT_BYTES} B "
                f"({len(held):,} of the prompts' held halves); filled in {seconds:.1f} s "
                f"({total / seconds:,.0f} puts/s); median of {args.repeats} re-asks; "
                f"load average {os.getloadavg()[0]:.1f}"
            )
            print(
                f"{'prompt':<34} {'keys (all)':>11} {'all keys ms':>12} {'search ms':>10} "
                f"{'ratio':>7} {'first ask ms':>13} {'(hash':>7} {'mask)':>6} "
                f"{'all keys KB: keys -> hashes':>28} {'search KB':>10}"
            )
            for row in rows:
                median = serve(row, store, args.repeats)
                ratio = median["all keys"] / median["search"]
                print(
                    f"{row.label:<34} {row.exact_keys:>11,} {median['all keys'] * 1e3:>12.1f} "
                    f"{median['search'] * 1e3:>10.2f} {ratio:>6.0f}x "
                    f"{median['first ask'] * 1e3:>13.1f} {median['hash'] * 1e3:>7.1f} "
                    f"{median['store mask'] * 1e3:>6.1f} "
                    f"{row.keyed_bytes() / 1e3:>15,.0f} -> {median['all keys bytes'] / 1e3:>8,.0f} "
                    f"{median['search bytes'] / 1e3:>10,.1f}",
                    flush=True,
                )
        finally:
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
