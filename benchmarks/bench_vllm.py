"""Time to first token of a vLLM instance, cold vs warm from another instance's stores.

A writer instance prefills a long prompt and stores its KV (and conv state) in a real
Mooncake pool (master + segment holder on loopback), then exits. A reference instance
without the connector measures cold TTFT; reader instances started afterwards measure warm
TTFT on prompts sharing the writer's prefix, whole-block and (if the connector accepts it)
layerwise. TTFT is vLLM's own ``first_token_latency`` of one request at a time, after a
warm-up request; medians of a few repetitions are printed side by side, with the ratio.
Runs standalone: ``python benchmarks/bench_vllm.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness

import tinymodels
from vllm_instance import InstanceError, InstanceResult, InstanceSpec, Step, run_instance

from hybridkv.transport import MasterProcess, SegmentHolder

BLOCK = 32
CHUNK = 512  # tokens prefilled per step


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(tinymodels.BUILDERS), default="lfm2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as scratch:
        root = Path(scratch)
        model = tinymodels.build(args.model, root / "models", args.layers, args.hidden)
        prefix = tinymodels.prompt_ids(1, args.prefix_tokens)
        # each repetition: the shared prefix plus a suffix of its own (a fresh request)
        prompts = [prefix + tinymodels.prompt_ids(100 + i, 16) for i in range(args.repeats)]
        warmup = Step(prompts=[tinymodels.prompt_ids(2, CHUNK + 8)], max_tokens=1, logprobs=1)

        def spec(connector: dict[str, object] | None, measured: list[list[int]]) -> InstanceSpec:
            return InstanceSpec(
                model=str(model.path),
                block_size=BLOCK,
                max_model_len=args.prefix_tokens + 256,
                max_num_batched_tokens=CHUNK,
                connector=connector,
                steps=[warmup, Step(prompts=measured, max_tokens=1, logprobs=1)],
            )

        def ttfts(result: InstanceResult) -> list[float]:
            return [p.first_token_latency_s for p in result.steps[1].prompts]

        runs = root / "runs"
        print(
            f"model {args.model} ({model.kv_groups}), {args.layers} layers, hidden "
            f"{args.hidden}, float32; prompt {len(prompts[0])} tokens "
            f"({args.prefix_tokens} shared), chunk {CHUNK}; medians of {args.repeats}",
            flush=True,
        )
        cold = run_instance(spec(None, prompts[:2]), runs, "cold", {})
        cold_ttft = statistics.median(ttfts(cold))
        print(f"cold TTFT (no connector)        {cold_ttft * 1e3:9.1f} ms", flush=True)

        with MasterProcess.start() as master, SegmentHolder.start(master.address, "1GB"):
            config_path = root / "mooncake.json"
            config_path.write_text(
                json.dumps(
                    {
                        "master_server_address": master.address,
                        "global_segment_size": 0,
                        "local_buffer_size": 128 << 20,
                    }
                )
            )
            env = {"MOONCAKE_CONFIG_PATH": str(config_path)}
            writer = run_instance(spec({"namespace": "bench"}, [[*prefix, 7]]), runs, "writer", env)
            print(
                f"writer TTFT (cold, storing)     {ttfts(writer)[0] * 1e3:9.1f} ms",
                flush=True,
            )
            for mode, layerwise in (("whole-block", False), ("layerwise", True)):
                connector = {"namespace": "bench", "use_layerwise": layerwise}
                try:
                    reader = run_instance(spec(connector, prompts), runs, f"reader-{mode}", env)
                except InstanceError as error:
                    last = str(error).strip().splitlines()[-1]
                    print(f"warm TTFT {mode:<21} not measured: the instance failed ({last})")
                    continue
                warm = statistics.median(ttfts(reader))
                hits = [p.external_hit_tokens for p in reader.steps[1].prompts]
                print(
                    f"warm TTFT {mode:<21} {warm * 1e3:9.1f} ms  cold/warm {cold_ttft / warm:5.2f}x"
                    f"  (external hits {hits})",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
