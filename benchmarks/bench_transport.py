"""Transport engine vs raw Mooncake on a DeepSeek-like layout, side by side in one run.

Layout: 61 layers, 3 groups (MLA latent, indexer keys, compressor state), 256 blocks per
group: one object per (group, block) holding all 61 layers' bytes. Two cache layouts, one
after the other: per-layer tensors (vLLM's layer-outermost layouts, the only one of its CPU
backend: the transport must lay the bytes out per object) and block-major tensors (vLLM's
block-outermost layouts, e.g. BLHNC, the only ones its DeepSeek-V4 indexer backend takes:
a block holds the group's layers back to back, so each object is one run of cache memory
and moves in place, no copy). The transport moves the objects layer by layer (put: a
layer once "ready", commit per group; get: each layer before it is "used") at "staged"
granularity (the default: layers copied into registered staging memory, one piece per
key; block-major objects in place), at "group" granularity (one multi-buffer call per group:
a piece per layer of each object for per-layer tensors, one per object for block-major
ones), for per-layer tensors also at "layer" granularity (ranged put/get sessions, no
copy), and whole (`save`/`load`, staged). Raw Mooncake moves the same
bytes with `batch_put_from` / `batch_get_into` from one contiguous buffer per object (the
best Mooncake can do, no layout work at all), through the very Mooncake client the transport
uses (two clients of one process read the same objects up to 2x apart here). Same process,
then a second process reading
what the first wrote (objects in a segment holder). `--repeats` passes after a warm-up
pass; in a pass each mode runs right beside a raw run of its own (the same store, the same
bytes, fresh keys; which of the two goes first alternates, and the modes rotate); a ratio
is the median over the passes of raw time / transport time, so above 1 the transport is
faster (the two runs of a pair are adjacent, so drifts of a shared machine cancel out),
with its range; speeds are from median times. Every get is checked byte for byte, into
memory zeroed before it. The holder maps its whole segment at start (its default), so no
pass pays the first touch of holder pages (a put into them takes about twice as long).
"put after last layer" is what a layerwise save leaves once its last layer was handed over,
"get until layer 0" how long a layerwise load keeps the first layer waiting: the parts a
forward pass cannot hide (a raw call leaves nothing usable before it returns), provided each
layer's compute lasts as long as its transfer and leaves the cores to it. The layers are
handed over back to back here, with no compute between them; "put stalled in checkpoints"
is how long the full backlog then held the model thread: what a forward pass with no time
per layer would add on top of the tail. The serial
reference is raw put (get) plus one numpy copy of the same bytes between per-layer tensors
and per-block objects: what host-side layout work costs when nothing overlaps it; the
overlapped reference runs that copy on a second thread during the raw call, paired with a
plain raw call (on 2 cores shared by client and holder, the loopback transfer leaves little
room to overlap it). Per-layer tensors cannot beat these two by much: they need the copy.

Starts its own master and segment holder on loopback; needs mooncake installed. Run:
`python benchmarks/bench_transport.py [--blocks N] [--repeats R] [--modes staged whole
layer group] [--layouts per-layer block-major]` (about half an hour on 2 cores with every
mode: ranged and multi-buffer moves of per-layer tensors take seconds a pass).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from hybridkv.transport import (
    BlockTransfer,
    CacheEntry,
    CpuEvent,
    GroupLayout,
    MasterProcess,
    MooncakeConfig,
    MooncakeStore,
    PipelineOptions,
    SegmentHolder,
    Store,
    TransferEngine,
)
from hybridkv.transport.integrity import IntegrityKey, TaggedStore
from hybridkv.transport.mooncake_client import load_client_class

LAYERS = 61
# group -> (cache name, bytes per block per layer): fp8 MLA latent (16 tokens x 576),
# indexer keys (16 x 132), a compressor state page.
GROUPS = {0: ("latent", 16 * 576), 1: ("indexer", 16 * 132), 2: ("state", 1024)}
MODES = {
    "layerwise, staged (default)": "staged",
    "whole objects, staged": "whole",
    "layerwise, ranged (layer)": "layer",
    "layerwise, multi-buffer (group)": "group",
}
# cache layout -> block-major? Ranged mode is left out for block-major caches: its pieces
# are one per layer either way.
LAYOUTS = {
    "per-layer tensors (vLLM's layer-outermost layouts; the CPU backend's only one)": False,
    "block-major tensors (vLLM's block-outermost layouts, e.g. BLHNC, which the DeepSeek-V4 "
    "indexer backend requires): each object is one run of cache memory, moved in place": True,
}


def modes_for(block_major: bool) -> dict[str, str]:
    return {label: mode for label, mode in MODES.items() if mode != "layer" or not block_major}


def keep_only(modes: list[str] | None) -> None:
    """Run only these modes (`--modes`; default every one)."""
    for label, mode in list(MODES.items()):
        if modes is not None and mode not in modes:
            del MODES[label]


class Caches:
    """One worker's KV tensors in numpy memory: [group][layer] -> (blocks, bytes).

    Per-layer: each (group, layer) its own tensor (vLLM's layer-outermost layouts, the
    CPU backend's only one). Block-major: one tensor per group whose blocks hold all of the
    group's layers back to back, padded to the largest group's block (vLLM's
    block-outermost layouts, e.g. BLHNC, the one the DeepSeek-V4 indexer backend requires):
    each object is then one run of cache memory.
    """

    def __init__(self, blocks: int, seed: int | None, block_major: bool) -> None:
        rng = np.random.default_rng(seed)
        self.blocks = blocks
        width = max(LAYERS * nbytes for _, nbytes in GROUPS.values())
        self.arrays: dict[tuple[int, int], np.ndarray] = {}
        for group, (_, nbytes) in GROUPS.items():
            memory = np.zeros((blocks, width), dtype=np.uint8) if block_major else None
            for layer in range(LAYERS):
                array = (
                    memory[:, layer * nbytes : (layer + 1) * nbytes]
                    if memory is not None
                    else np.zeros((blocks, nbytes), dtype=np.uint8)
                )
                if seed is not None:
                    array[:] = rng.integers(0, 256, size=array.shape, dtype=np.uint8)
                self.arrays[(group, layer)] = array
        self.layouts = [
            GroupLayout(
                group,
                [
                    CacheEntry(
                        layer,
                        name,
                        self.arrays[(group, layer)].ctypes.data,
                        nbytes,
                        self.arrays[(group, layer)].strides[0],
                        num_blocks=blocks,
                    )
                    for layer in range(LAYERS)
                ],
            )
            for group, (name, nbytes) in GROUPS.items()
        ]

    def objects(self) -> np.ndarray:
        """The objects as one contiguous buffer per (group, block): raw Mooncake's input."""
        width = max(layout.object_size for layout in self.layouts)
        flat = np.zeros((len(GROUPS), self.blocks, width), dtype=np.uint8)
        self.gather_into(flat)
        return flat

    def gather_into(self, flat: np.ndarray) -> None:
        """Assemble every object from the per-layer tensors: one strided numpy copy per
        tensor, the least any host-side layout work can cost."""
        for group, (_, nbytes) in GROUPS.items():
            for layer in range(LAYERS):
                flat[group, :, layer * nbytes : (layer + 1) * nbytes] = self.arrays[(group, layer)]

    def clear(self) -> None:
        for array in self.arrays.values():
            array[:] = 0

    def same_as(self, other: Caches) -> bool:
        return all(np.array_equal(self.arrays[k], other.arrays[k]) for k in self.arrays)


def transfers(prefix: str, blocks: int) -> list[BlockTransfer]:
    return [
        BlockTransfer(f"{prefix}@group:{group}@{block}", group, block, prefix, block)
        for group in GROUPS
        for block in range(blocks)
    ]


def raw_client(master: str) -> Any:
    client = load_client_class()()
    code = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master)
    if code != 0:
        raise RuntimeError(f"raw Mooncake client setup failed with {code}")
    return client


def raw_args(
    caches: Caches, flat: np.ndarray, prefix: str
) -> tuple[list[str], list[int], list[int]]:
    keys, ptrs, sizes = [], [], []
    for layout in caches.layouts:
        for block in range(caches.blocks):
            keys.append(f"{prefix}@group:{layout.group_id}@{block}")
            ptrs.append(flat[layout.group_id, block].ctypes.data)
            sizes.append(layout.object_size)
    return keys, ptrs, sizes


def layout_tag(block_major: bool) -> str:
    """Part of every key, so that no layout finds the other's objects."""
    return "bm-" if block_major else "pl-"


def checked(codes: list[int], what: str) -> None:
    bad = [code for code in codes if code < 0]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} keys failed, e.g. {bad[0]}")


def rotated(engines: dict[str, Any], repeat: int) -> list[tuple[bool, str, Any]]:
    """The modes in a different order each pass, each with whether it runs before its raw
    twin (alternating, so neither side always runs first)."""
    items = list(engines.items())
    shift = repeat % len(items)
    order = items[shift:] + items[:shift]
    return [(bool((repeat + i) % 2), mode, engine) for i, (mode, engine) in enumerate(order)]


def in_order(first: Callable[[], Any], second: Callable[[], Any], swap: bool) -> tuple[Any, Any]:
    """Both results, as (first's, second's), having run `second` first when `swap`."""
    if swap:
        later = second()
        return first(), later
    earlier = first()
    return earlier, second()


def timed(work: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    started = time.perf_counter()
    result = work(*args)
    return time.perf_counter() - started, result


def timed_beside(
    beside: Callable[[], Any] | None, work: Callable[..., Any], *args: Any
) -> tuple[float, Any]:
    """(seconds, result) of one call with `beside` (if any) running at the same time on a
    second thread, until both are done."""
    if beside is None:
        return timed(work, *args)
    helper = threading.Thread(target=beside)
    started = time.perf_counter()
    helper.start()
    try:
        result = work(*args)
    finally:
        helper.join()
    return time.perf_counter() - started, result


def transport_put(
    engine: TransferEngine, saves: list[BlockTransfer], mode: str
) -> tuple[float, float]:
    """Save; returns the seconds left after the last layer was handed over (the part a
    forward pass cannot hide: the whole save for "whole") and the seconds checkpoints held
    the caller while the backlog was full."""
    stalled = 0.0
    if mode == "whole":
        handed_over = time.perf_counter()
        result = engine.save(saves).wait()
    else:
        step = engine.begin_layerwise(saves=saves)
        for layer in range(LAYERS):
            step.save_layer(layer, CpuEvent())
            stalled += timed(step.checkpoint)[0]
        handed_over = time.perf_counter()
        result = step.finish()
    if not result.ok:
        raise RuntimeError(f"transport put failed for {len(result.failed_keys)} keys")
    if result.skipped_keys or result.contended_keys:  # a left-over object: nothing moved
        raise RuntimeError(f"transport put found {len(result.skipped_keys)} keys stored already")
    return time.perf_counter() - handed_over, stalled


def transport_get(
    engine: TransferEngine, loads: list[BlockTransfer], mode: str
) -> tuple[int, float]:
    """Load; returns how many keys failed (reported, not raised: the bench shows it) and
    the seconds until the first layer was usable (the part a forward pass cannot hide:
    the whole load for "whole")."""
    started = time.perf_counter()
    if mode == "whole":
        result = engine.load(loads).wait()
        first_layer = time.perf_counter()
    else:
        step = engine.begin_layerwise(loads=loads)
        step.wait_layer_loaded(0)
        first_layer = time.perf_counter()
        for layer in range(1, LAYERS):
            step.wait_layer_loaded(layer)
        result = step.finish()
    return len(result.failed_keys), first_layer - started


def engine_for(store: Store, caches: Caches, mode: str) -> TransferEngine:
    granularity = "staged" if mode == "whole" else mode
    return TransferEngine(store, caches.layouts, PipelineOptions(granularity=granularity))


def connect(master: str) -> tuple[MooncakeStore, Any]:
    """The transport's store and the very Mooncake client under it, which the raw twins
    call: both sides share one transfer engine. (Two clients of one process read the same
    objects up to 2x apart here, depending on what each did before, so a raw twin with a
    client of its own measured that client as much as the transport.) Closing the store
    closes the client."""
    client = raw_client(master)
    # Lend nothing: objects live in the holder and outlive this process.
    config = MooncakeConfig(
        master_server_address=master, global_segment_size=0, local_buffer_size=64 << 20
    )
    return MooncakeStore(client, config), client


def read_all(
    master: str, blocks: int, prefixes: dict[str, str], repeats: int, block_major: bool
) -> dict[str, list[float]]:
    """Get times per pass (after the warm-up) per mode and of its raw twin, of objects
    another process wrote; checks bytes and raises on any failed key."""
    expected = Caches(blocks, seed=1, block_major=block_major)
    target = Caches(blocks, seed=None, block_major=block_major)
    want = expected.objects()
    flat = np.zeros_like(want)
    store, client = connect(master)
    client.register_buffer(flat.ctypes.data, flat.nbytes)
    times: dict[str, list[float]] = {}
    keys, ptrs, sizes = raw_args(expected, flat, prefixes["raw"])
    engines = {mode: engine_for(store, target, mode) for mode in modes_for(block_major).values()}
    samples: dict[str, list[float]] = {
        name: [] for mode in engines for name in (mode, f"{mode} first layer", f"{mode} raw")
    }

    def raw_get() -> float:
        flat[:] = 0
        seconds, codes = timed(client.batch_get_into, keys, ptrs, sizes)
        checked(codes, "raw get")
        if not np.array_equal(flat, want):
            raise RuntimeError("raw get returned wrong bytes")
        return seconds

    def ours(mode: str, engine: TransferEngine) -> tuple[float, float]:
        target.clear()
        seconds, (failed, first_s) = timed(
            transport_get, engine, transfers(prefixes[mode], blocks), mode
        )
        if failed:
            raise RuntimeError(f"transport get ({mode}): {failed} keys failed")
        if not target.same_as(expected):
            raise RuntimeError(f"transport get ({mode}) returned wrong bytes")
        return seconds, first_s

    try:
        for repeat in range(repeats + 1):  # pass 0 warms both paths up
            for swap, mode, engine in rotated(engines, repeat):
                raw_s, (seconds, first_s) = in_order(raw_get, partial(ours, mode, engine), swap)
                samples[f"{mode} raw"].append(raw_s)
                samples[mode].append(seconds)
                samples[f"{mode} first layer"].append(first_s)
        times.update({name: runs[1:] for name, runs in samples.items()})
    finally:
        for engine in engines.values():
            engine.close()
        store.close()
    return times


Samples = dict[str, list[list[float]]]  # name -> per measure, its passes after the warm-up


def same_process(
    master: str, blocks: int, repeats: int, block_major: bool
) -> tuple[Samples, dict[str, str]]:
    """Every mode and its raw twin put then get, pass by pass; also the last pass's key
    prefixes (left in the pool for the cross-process reader)."""
    tag = layout_tag(block_major)
    source = Caches(blocks, seed=1, block_major=block_major)
    target = Caches(blocks, seed=None, block_major=block_major)
    store, client = connect(master)
    flat = source.objects()
    back = np.zeros_like(flat)
    for buffer in (flat, back):
        client.register_buffer(buffer.ctypes.data, buffer.nbytes)
    # One engine per process and memory, as in a deployment: staging is set up
    # (registered, pages mapped) once, not per transfer.
    engines = {
        mode: (engine_for(store, source, mode), engine_for(store, target, mode))
        for mode in modes_for(block_major).values()
    }
    scratch = np.zeros_like(flat)
    # name -> per pass: (put, get, after the last layer, stalled in checkpoints, until the
    # first layer, raw twin's put, raw twin's get); "gather" -> per pass: (seconds,);
    # "beside" -> per pass: (put, get with the gather beside each; a plain put, get)
    names = ["gather", "beside", *engines]
    samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
    kept: dict[str, str] = {}  # what the reader gets: the last pass's objects

    def raw_round_trip(prefix: str, beside: Callable[[], Any] | None = None) -> tuple[float, float]:
        keys, ptrs, sizes = raw_args(source, flat, prefix)
        put_s, codes = timed_beside(beside, client.batch_put_from, keys, ptrs, sizes)
        checked(codes, "raw put")
        back[:] = 0
        back_ptrs = [ptr - flat.ctypes.data + back.ctypes.data for ptr in ptrs]
        get_s, codes = timed_beside(beside, client.batch_get_into, keys, back_ptrs, sizes)
        checked(codes, "raw get")
        if not np.array_equal(back, flat):
            raise RuntimeError("raw round trip returned wrong bytes")
        return put_s, get_s

    def round_trip(
        mode: str, writer: TransferEngine, reader: TransferEngine, saves: list[BlockTransfer]
    ) -> tuple[float, ...]:
        target.clear()
        put_s, (tail_s, stalled_s) = timed(transport_put, writer, saves, mode)
        get_s, (failed, first_s) = timed(transport_get, reader, saves, mode)
        if failed:
            raise RuntimeError(f"transport get ({mode}): {failed} keys failed")
        if not target.same_as(source):
            raise RuntimeError(f"transport round trip ({mode}): wrong bytes")
        return put_s, get_s, tail_s, stalled_s, first_s

    try:
        for repeat in range(repeats + 1):  # pass 0 warms both paths up
            samples["gather"].append(timed(source.gather_into, scratch)[:1])
            if not block_major:  # raw with the layout copy beside it, and without
                pair = [f"{tag}beside{repeat}", f"{tag}plain{repeat}"]
                beside, plain = in_order(
                    partial(raw_round_trip, pair[0], partial(source.gather_into, scratch)),
                    partial(raw_round_trip, pair[1]),
                    bool(repeat % 2),
                )
                samples["beside"].append(beside + plain)
                removed = [t.key for p in pair for t in transfers(p, blocks)]
                checked(client.batch_remove(removed, True), "remove")
            for swap, mode, (writer, reader) in rotated(engines, repeat):
                prefix, raw_prefix = f"{tag}{mode}{repeat}", f"{tag}raw-{mode}{repeat}"
                saves = transfers(prefix, blocks)
                raw_times, ours = in_order(
                    partial(raw_round_trip, raw_prefix),
                    partial(round_trip, mode, writer, reader, saves),
                    swap,
                )
                samples[mode].append(ours + raw_times)
                if repeat == repeats:  # the reader's: one raw twin and every mode
                    kept[mode] = prefix
                    kept.setdefault("raw", raw_prefix)
                # raw keys are named as the transport's (`raw_args`, `transfers`)
                gone = [p for p in (prefix, raw_prefix) if p not in kept.values()]
                if gone:
                    removed = [t.key for p in gone for t in transfers(p, blocks)]
                    checked(client.batch_remove(removed, True), "remove")
    finally:
        for writer, reader in engines.values():
            writer.close()
            reader.close()
        store.close()
    same = {
        name: [list(column[1:]) for column in zip(*runs, strict=True)]
        for name, runs in samples.items()
    }
    return same, kept


def cross_process(
    master: str, blocks: int, repeats: int, block_major: bool, prefixes: dict[str, str]
) -> dict[str, list[float]]:
    """A second process reads what the first wrote."""
    command = [sys.executable, __file__, "--reader", master, "--blocks", str(blocks)]
    command += ["--repeats", str(repeats), "--prefixes", json.dumps(prefixes)]
    command += ["--modes", *MODES.values()]
    if block_major:
        command.append("--block-major")
    child = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"reader process failed:\n{child.stderr[-4000:]}")
    times: dict[str, list[float]] = json.loads(child.stdout.strip().splitlines()[-1])
    return times


def paired(raw: list[float], ours: list[float]) -> str:
    """Median and range of raw / transport over the passes, each pass's two runs adjacent
    in time (drifts of a shared machine cancel out of each ratio)."""
    ratios = sorted(r / o for r, o in zip(raw, ours, strict=True))
    return f"ratio {statistics.median(ratios):5.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def wait_line(label: str, raw: list[float], ours: list[float]) -> str:
    """A wait the model thread sees: raw's whole call against what the transport leaves."""
    return (
        f"  {label:<34} raw {statistics.median(raw) * 1e3:6.0f} ms    transport "
        f"{statistics.median(ours) * 1e3:6.0f} ms    {paired(raw, ours)}"
    )


def ratio_line(label: str, raw: list[float], ours: list[float], nbytes: int) -> str:
    return (
        f"  {label:<34} raw {nbytes / statistics.median(raw) / 1e9:6.2f} GB/s  transport "
        f"{nbytes / statistics.median(ours) / 1e9:6.2f} GB/s  {paired(raw, ours)}"
    )


def plus(first: list[float], second: list[float]) -> list[float]:
    return [a + b for a, b in zip(first, second, strict=True)]


def report(same: Samples, cross: dict[str, list[float]], block_major: bool, total: int) -> None:
    modes = modes_for(block_major)
    print("same process (put, then get into other memory):")
    for label, mode in modes.items():
        put_s, get_s, tail_s, stalled_s, first_s, raw_put, raw_get = same[mode]
        print(ratio_line(f"{label}: put", raw_put, put_s, total))
        if mode != "whole":
            print(wait_line(f"{label}: put after last layer", raw_put, tail_s))
            print(
                f"  {label}: put stalled in checkpoints (no compute between layers) "
                f"{statistics.median(stalled_s) * 1e3:.0f} ms"
            )
        print(ratio_line(f"{label}: get", raw_get, get_s, total))
        if mode != "whole":
            print(wait_line(f"{label}: get until layer 0", raw_get, first_s))
        print(
            ratio_line(f"{label}: put+get", plus(raw_put, raw_get), plus(put_s, get_s), 2 * total)
        )
    if not block_major:
        [gather] = same["gather"]
        raw_put, raw_get = same[next(iter(modes.values()))][-2:]
        print(
            f"serial reference: raw + one numpy copy of the same bytes between per-layer "
            f"tensors and per-block objects ({statistics.median(gather) * 1e3:.0f} ms) = put "
            f"{paired(raw_put, plus(raw_put, gather))}, get "
            f"{paired(raw_get, plus(raw_get, gather))}"
        )
        put_beside, get_beside, put_plain, get_plain = same["beside"]
        print(
            f"overlapped reference: raw with that copy running at the same time on a second "
            f"thread = put "
            f"{paired(put_plain, put_beside)}, get {paired(get_plain, get_beside)}"
        )
    print("cross process (a second process reads what this one wrote):")
    for label, mode in modes.items():
        raw = cross[f"{mode} raw"]
        print(ratio_line(f"{label}: get", raw, cross[mode], total))
        if mode != "whole":
            print(wait_line(f"{label}: get until layer 0", raw, cross[f"{mode} first layer"]))


def integrity(master: str, blocks: int, repeats: int) -> None:
    """Whole save then load (staged) with integrity tags on and off, side by side: each
    pass runs both (which goes first alternates) through one client, fresh keys each."""
    source = Caches(blocks, seed=1, block_major=False)
    target = Caches(blocks, seed=None, block_major=False)
    store, client = connect(master)
    tagged = TaggedStore(store, IntegrityKey(b"bench secret, not a real one...."))
    engines = {
        "off": (engine_for(store, source, "whole"), engine_for(store, target, "whole")),
        "on": (engine_for(tagged, source, "whole"), engine_for(tagged, target, "whole")),
    }
    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}

    def round_trip(name: str, repeat: int) -> tuple[float, float]:
        writer, reader = engines[name]
        saves = transfers(f"integrity-{name}{repeat}", blocks)
        target.clear()
        put_s, _ = timed(transport_put, writer, saves, "whole")
        get_s, (failed, _) = timed(transport_get, reader, saves, "whole")
        if failed or not target.same_as(source):
            raise RuntimeError(f"integrity {name}: {failed} keys failed or wrong bytes")
        checked(client.batch_remove([t.key for t in saves], True), "remove")
        return put_s, get_s

    try:
        for repeat in range(repeats + 1):  # pass 0 warms both paths up
            off, on = in_order(
                partial(round_trip, "off", repeat), partial(round_trip, "on", repeat),
                bool(repeat % 2),
            )  # fmt: skip
            if repeat:
                times["off"].append(off)
                times["on"].append(on)
    finally:
        for writer, reader in engines.values():
            writer.close()
            reader.close()
        tagged.close()
    flat = source.objects()
    hash_s = min(timed(tagged_bytes, flat)[0] for _ in range(3))
    total = blocks * LAYERS * sum(nbytes for _, nbytes in GROUPS.values())
    (off_put, off_get), (on_put, on_get) = (list(zip(*times[n], strict=True)) for n in times)
    print(f"\nintegrity tags (whole save/load, staged, per-layer tensors, {total / 1e6:.0f} MB):")
    print(f"  keyed BLAKE2b alone over the same bytes: {total / hash_s / 1e9:.2f} GB/s")
    for label, off_s, on_s in (("put", off_put, on_put), ("get", off_get, on_get)):
        print(
            f"  {label}: off {total / statistics.median(off_s) / 1e9:6.2f} GB/s  on "
            f"{total / statistics.median(on_s) / 1e9:6.2f} GB/s  on/off time "
            f"{paired(list(on_s), list(off_s))}"
        )


def tagged_bytes(flat: np.ndarray) -> bytes:
    """A keyed BLAKE2b over `flat`, as the integrity tag hashes each object."""
    return IntegrityKey(b"bench secret, not a real one....").tag(
        "k", [flat.ctypes.data], [flat.nbytes]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reader", help=argparse.SUPPRESS)  # master address (child)
    parser.add_argument("--prefixes", help=argparse.SUPPRESS)
    parser.add_argument("--block-major", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES.values()), help="default: every mode"
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=["per-layer", "block-major"],
        default=["per-layer", "block-major"],
    )
    parser.add_argument(
        "--integrity-only", action="store_true", help="only integrity tags on vs off"
    )
    args = parser.parse_args()
    keep_only(args.modes)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    if args.reader:
        prefixes = json.loads(args.prefixes)
        times = read_all(args.reader, args.blocks, prefixes, args.repeats, args.block_major)
        print(json.dumps(times))
        return 0

    total = args.blocks * LAYERS * sum(nbytes for _, nbytes in GROUPS.values())
    print(
        f"bench_transport: {LAYERS} layers, {len(GROUPS)} groups, {args.blocks} blocks, "
        f"{total / 1e6:.0f} MB per pass, median of {args.repeats} after a warm-up pass"
    )
    # each mode's objects, the raw twin kept for the reader and the one of the pair running
    holder_bytes = (2 if args.integrity_only else len(MODES) + 2) * total + (256 << 20)
    with MasterProcess.start() as master, SegmentHolder.start(master.address, holder_bytes):
        for label, block_major in LAYOUTS.items():
            if args.integrity_only:
                break
            if ("block-major" if block_major else "per-layer") not in args.layouts:
                continue
            same, prefixes = same_process(master.address, args.blocks, args.repeats, block_major)
            cross = cross_process(master.address, args.blocks, args.repeats, block_major, prefixes)
            cleaner = raw_client(master.address)  # room in the holder for the next layout
            left = [t.key for prefix in prefixes.values() for t in transfers(prefix, args.blocks)]
            checked(cleaner.batch_remove(left, True), "remove")
            cleaner.close()
            print(f"\n{label}:")
            report(same, cross, block_major, total)
        integrity(master.address, args.blocks, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
