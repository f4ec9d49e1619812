"""hybridkv demo: a second vLLM instance reuses a hybrid model's prefix from a Mooncake pool.

All on this machine, loopback only:
1. builds a tiny random LFM2 model (conv state + full attention: two KV cache groups);
2. starts a real ``mooncake_master`` and a segment holder that lends the pool its memory;
3. reference: an instance without the connector answers question 2 from scratch;
4. instance A (its own process) answers question 1 about a long document, stores the
   document's KV and conv state in the pool, and exits;
5. instance B (a new process) answers question 2 about the same document: it finds the
   document in the pool, loads it and computes only the question.
It prints a small table (prefix reused, time to first token) and whether B's tokens and
top-5 logprobs are bit-identical to the reference's; it exits 1 if they are not.

Every instance prefills in the same chunks (the document is a whole number of them), so
B computes the question exactly as the reference does, and runs its engine in its own
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a multi-threaded worker process was seen
to move logprobs by ~1e-5 at this model size, which would blur "identical".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import tinymodels
from vllm_instance import InstanceSpec, Step, logprob_gap, run_instance, write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder

BLOCK = 32
CHUNK = 512  # tokens prefilled per step; the document is a whole number of chunks
QUESTION_TOKENS = 32
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(tinymodels.BUILDERS), default="lfm2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--document-chunks", type=int, default=4, help=f"x {CHUNK} tokens")
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument(
        "--layerwise", action="store_true", help="move KV layer by layer (use_layerwise)"
    )
    return parser.parse_args()


def _say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    args = _parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridkv-demo-") as scratch:
        root = Path(scratch)
        model = tinymodels.build(args.model, root / "models", args.layers, args.hidden)
        document = tinymodels.prompt_ids(1, args.document_chunks * CHUNK)
        question_1 = document + tinymodels.prompt_ids(2, QUESTION_TOKENS)
        question_2 = document + tinymodels.prompt_ids(3, QUESTION_TOKENS)
        warmup = tinymodels.prompt_ids(4, CHUNK + 8)  # the first request pays one-off costs

        def spec(connector: dict[str, object] | None, prompt: list[int]) -> InstanceSpec:
            return InstanceSpec(
                model=str(model.path),
                block_size=BLOCK,
                max_num_batched_tokens=CHUNK,
                connector=connector,
                steps=[
                    Step(prompts=[warmup], max_tokens=1, logprobs=1),
                    Step(prompts=[prompt], max_tokens=args.answer_tokens, logprobs=5),
                ],
            )

        mode = "layerwise" if args.layerwise else "whole-block"
        _say("hybridkv demo: vLLM instance B reuses what instance A left in a Mooncake pool")
        _say(
            f"  model   tiny random {args.model}, {args.layers} layers, hidden {args.hidden}, "
            f"float32: {model.kv_groups}"
        )
        _say(
            f"  prompt  {len(question_2)} tokens: a {len(document)}-token document shared by "
            f"both questions + a {QUESTION_TOKENS}-token question"
        )
        _say(f"  running the reference, A, then B ({mode} transfers) ...")
        runs = root / "runs"
        reference = run_instance(spec(None, question_2), runs, "reference", ENGINE_ENV)
        with MasterProcess.start() as master, SegmentHolder.start(master.address, "256MB"):
            config_path = write_pool_config(root / "mooncake.json", master.address)
            env = {**ENGINE_ENV, "MOONCAKE_CONFIG_PATH": str(config_path)}
            connector = {"namespace": "demo", "use_layerwise": args.layerwise}
            a = run_instance(spec(connector, question_1), runs, "instance-A", env)
            b = run_instance(spec(connector, question_2), runs, "instance-B", env)

    cold = reference.steps[1].prompts[0]
    writer = a.steps[1].prompts[0]
    warm = b.steps[1].prompts[0]
    rows = [
        ("reference: question 2, no pool", "-", cold),
        ("A: question 1, stores the document", f"{writer.external_hit_tokens} tokens", writer),
        ("B: question 2, new process after A", f"{warm.external_hit_tokens} tokens", warm),
    ]
    _say("")
    _say(f"  {'instance':<36} {'prefix from pool':>16} {'time to first token':>21}")
    for name, hit, result in rows:
        _say(f"  {name:<36} {hit:>16} {result.first_token_latency_s * 1e3:>18.1f} ms")
    _say("")

    gap = logprob_gap(warm, cold)
    problems = []
    if warm.external_hit_tokens == 0:
        problems.append("B found nothing in the pool: no prefix was reused")
    if warm.token_ids != cold.token_ids:
        problems.append(f"tokens differ: B {warm.token_ids}, reference {cold.token_ids}")
    elif gap != 0.0:
        problems.append(f"top-5 logprobs differ by up to {gap:.3g}")
    if problems:
        _say("  outputs identical: NO")
        for problem in problems:
            _say(f"    {problem}")
        return 1
    speedup = cold.first_token_latency_s / warm.first_token_latency_s
    _say(
        f"  outputs identical: yes (same {len(warm.token_ids)} tokens, top-5 logprobs "
        f"bit-identical at every position)"
    )
    _say(f"  B's first token came {speedup:.1f}x sooner than the reference's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
