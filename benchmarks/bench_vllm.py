"""Time to first token of vLLM with hybridkv: cold, storing, and warm from another instance.

Every instance is its own process with the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the connector's running transfer totals can be
read), on a real Mooncake pool (master + segment holder on loopback). In order:

1. no connector: cold TTFT of the long prompt;
2. a whole-block writer: the same prompt cold while storing it (store overhead = writer /
   cold), then exits;
3. a whole-block reader: the prompt's prefix comes from the writer's objects (warm);
4. layerwise instances, one per (prefetch, backlog) setting: each first stores a prompt of
   its own (cold + layerwise puts: the backlog and step-end waits), then reads the writer's
   prefix (warm: the get waits). The exposed tail is the forward time spent blocked on
   transfers, from the connector's counters.

A hybrid model (more than one KV cache group, e.g. the default LFM2) loads every hit in
the background, layerwise or not: vLLM recomputes a failed load of such a model only for a
request still waiting for its KV. Its layerwise instances then differ from the whole-block
ones in their saves only; ``--model llama`` measures layer-by-layer loads.

TTFT is vLLM's own ``first_token_latency`` of one request at a time after a warm-up
request; figures are medians of ``--repeats`` requests. Ratios compare runs made one after
another on the same machine, so a busy machine skews them: read them on a quiet one.
Run: ``python benchmarks/bench_vllm.py`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness

import tinymodels
from figures import CHUNK, ms, transfer_median, ttft, ttft_spec
from load_watch import LoadWatch
from vllm_instance import (
    InstanceResult,
    run_instance,
    write_pool_config,
)

from hybridkv.transport import MasterProcess, SegmentHolder

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # transfer totals need it
PREFETCH = (0, 1, 2, 4)
BACKLOG_DEFAULT = 8


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(tinymodels.BUILDERS), default="lfm2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.runs = root / "runs"
        self.model = tinymodels.build(args.model, root / "models", args.layers, args.hidden)
        self.prefix = tinymodels.prompt_ids(1, args.prefix_tokens)
        # the warm requests: the shared prefix plus a suffix of their own
        self.warm_prompts: list[list[int]] = [
            self.prefix + tinymodels.prompt_ids(100 + i, 16) for i in range(args.repeats)
        ]
        self.env: dict[str, str] = dict(IN_PROCESS)

    def fresh_prompt(self, seed: int) -> list[int]:
        """A prompt as long as the warm ones that nothing has stored."""
        prompt: list[int] = tinymodels.prompt_ids(seed, len(self.warm_prompts[0]))
        return prompt

    def run(
        self, name: str, connector: dict[str, object] | None, steps: list[list[list[int]]]
    ) -> InstanceResult:
        spec = ttft_spec(str(self.model.path), self.args.prefix_tokens, connector, steps)
        return run_instance(spec, self.runs, name, self.env)


def main() -> int:
    args = _parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as scratch:
        bench = Bench(args, Path(scratch))
        n = len(bench.warm_prompts[0])
        print(
            f"bench_vllm: {args.model} ({bench.model.kv_groups}), {args.layers} layers, hidden "
            f"{args.hidden}, float32; prompt {n} tokens ({args.prefix_tokens} "
            f"shared), {CHUNK}-token chunks; TTFT medians of {len(bench.warm_prompts)} "
            "requests, each instance a process of its own",
            flush=True,
        )
        if bench.model.hybrid:
            print(
                "  (hybrid model: every reader loads in the background, so the layerwise "
                "instances differ in their saves only; --model llama loads layer by layer)",
                flush=True,
            )
        load = LoadWatch()
        fresh = [bench.fresh_prompt(200 + i) for i in range(len(bench.warm_prompts))]
        cold = ttft(bench.run("cold", None, [fresh]).steps[1].prompts)
        print(f"  cold, no connector             TTFT {ms(cold)} ms", flush=True)

        with MasterProcess.start() as master, SegmentHolder.start(master.address, "2GB"):
            config_path = Path(scratch) / "mooncake.json"
            write_pool_config(config_path, master.address, 256 << 20)
            bench.env["MOONCAKE_CONFIG_PATH"] = str(config_path)
            shared: dict[str, object] = {"namespace": "bench"}
            # the writer stores the shared prefix (first prompt) and two fresh prompts
            writer_prompts = [bench.warm_prompts[0], *fresh[1:]]
            writer = bench.run("writer", shared, [writer_prompts]).steps[1].prompts
            stored = ttft(writer)
            print(
                f"  whole-block writer (storing)   TTFT {ms(stored)} ms"
                f"   store overhead {stored / cold:5.2f}x cold",
                flush=True,
            )
            reader = bench.run("reader-whole", shared, [bench.warm_prompts]).steps[1].prompts
            warm_whole = ttft(reader)
            print(
                f"  whole-block reader (warm)      TTFT {ms(warm_whole)} ms"
                f"   cold/warm {cold / warm_whole:5.2f}x   hits "
                f"{[p.external_hit_tokens for p in reader]}",
                flush=True,
            )

            settings = [(p, BACKLOG_DEFAULT) for p in PREFETCH] + [(2, 0)]
            rows = []
            for seed, (prefetch, backlog) in enumerate(settings, start=300):
                connector = {
                    **shared,
                    "use_layerwise": True,
                    "layerwise_prefetch_layers": prefetch,
                    "_layerwise_backlog": backlog,
                }
                result = bench.run(
                    f"layerwise-p{prefetch}-b{backlog}",
                    connector,
                    [[bench.fresh_prompt(seed)], bench.warm_prompts],
                )
                rows.append((prefetch, backlog, result.steps[1].prompts, result.steps[2].prompts))
                if (prefetch, backlog) == (2, BACKLOG_DEFAULT):
                    warm_layerwise = ttft(result.steps[2].prompts)
                    print(
                        f"  layerwise reader (warm)        TTFT {ms(warm_layerwise)} ms"
                        f"   cold/warm {cold / warm_layerwise:5.2f}x   layerwise/whole-block "
                        f"{warm_layerwise / warm_whole:5.2f}x",
                        flush=True,
                    )
        print(
            "\n  exposed transfer tail, layerwise (ms of forward blocked on transfers, medians)"
            "\n  prefetch backlog | storing: TTFT  backlog_wait finish_wait      tail | "
            "warm: TTFT  load_wait finish_wait      tail"
        )
        for prefetch, backlog, storing, warm in rows:
            store_waits = ("backlog_wait_s", "finish_wait_s", "exposed_tail_s")
            load_waits = ("load_wait_s", "finish_wait_s", "exposed_tail_s")
            print(
                f"  {prefetch:8d} {backlog:7d} | {ms(ttft(storing))} "
                + "    ".join(ms(transfer_median(storing, key)) for key in store_waits)
                + f" | {ms(ttft(warm))} "
                + "    ".join(ms(transfer_median(warm, key)) for key in load_waits)
            )
        print(load.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
