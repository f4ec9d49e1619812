"""The weights fingerprint's start-up cost on a 100 GB checkpoint, beside hashing it whole.

The checkpoint is sparse files (a real safetensors header each, the tensor bytes holes),
so the figures are the fingerprint's own work (headers, seeks, sampled reads, hashing)
from the page cache: the seeks of a cold disk come on top (at most 512 reads a shard).
Runs standalone: ``python benchmarks/bench_weights.py [--shards N] [--gb G]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

from hybridkv.integration import weights

TARGET_S = 1.0
TENSORS_PER_SHARD = 560  # DeepSeek-V3's checkpoint: ~91k tensors in 163 shards
WHOLE_HASH_SAMPLE = 1 << 30  # bytes hashed for the "hash it all" reference


def sparse_shard(path: Path, size: int) -> None:
    tensor = size // TENSORS_PER_SHARD
    header = {
        f"model.layers.{index // 8}.w{index % 8}": {
            "dtype": "BF16",
            "shape": [tensor // 2],
            "data_offsets": [index * tensor, (index + 1) * tensor],
        }
        for index in range(TENSORS_PER_SHARD)
    }
    encoded = json.dumps(header).encode()
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        file.truncate(8 + len(encoded) + TENSORS_PER_SHARD * tensor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--gb", type=float, default=100.0, help="checkpoint size in GB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        shard_bytes = int(args.gb * 1e9 / args.shards)
        for shard in range(args.shards):
            sparse_shard(root / f"model-{shard:05d}.safetensors", shard_bytes)
        (root / "config.json").write_text("{}")
        times = []
        for _ in range(args.repeats):
            weights._fingerprint.cache_clear()
            began = time.perf_counter()
            weights.weights_fingerprint(root)
            times.append(time.perf_counter() - began)
        began = time.perf_counter()
        weights.weights_fingerprint(root)
        cached = time.perf_counter() - began
        digest = hashlib.blake2b()
        began = time.perf_counter()
        with (root / "model-00000.safetensors").open("rb") as file:
            while file.tell() < WHOLE_HASH_SAMPLE and (chunk := file.read(16 << 20)):
                digest.update(chunk)
        whole = (time.perf_counter() - began) * args.gb * 1e9 / WHOLE_HASH_SAMPLE
    best = min(times)
    print(
        f"weights fingerprint, {args.gb:g} GB in {args.shards} shards x {TENSORS_PER_SHARD} "
        f"tensors (sparse files, page cache)"
    )
    print(f"  fingerprint, uncached: best {best * 1e3:.1f} ms, worst {max(times) * 1e3:.1f} ms")
    print(f"  fingerprint, cached (same process): {cached * 1e3:.2f} ms")
    print(f"  target {TARGET_S:.1f} s: best / target = {best / TARGET_S:.3f}")
    print(
        f"  hashing every byte instead (blake2b, extrapolated from 1 GiB): {whole:.1f} s, "
        f"{whole / best:.0f}x the fingerprint"
    )


if __name__ == "__main__":
    main()
