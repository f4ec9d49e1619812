"""How the vLLM TTFT benchmarks shape their instances and summarise their requests:
medians, printed in milliseconds."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import tinymodels
from vllm_instance import InstanceSpec, PromptResult, Step

BLOCK = 32
CHUNK = 512  # tokens prefilled per step; a shared prefix is a whole number of chunks


def median(values: Iterable[float]) -> float:
    """The median, nan for no values (a run that measured nothing prints as such)."""
    collected = list(values)
    return statistics.median(collected) if collected else float("nan")


def ttft(prompts: Sequence[PromptResult]) -> float:
    """vLLM's own time to first token, median over the requests, in seconds."""
    return median(p.first_token_latency_s for p in prompts)


def transfer_median(prompts: Sequence[PromptResult], key: str) -> float:
    """Median of one of the connector's transfer counters (`load_wait_s`...), in seconds."""
    return median((p.transfer or {}).get(key, float("nan")) for p in prompts)


def ttft_spec(
    model: str,
    prefix_tokens: int,
    connector: dict[str, object] | None,
    steps: Sequence[Sequence[list[int]]],
) -> InstanceSpec:
    """An instance of the TTFT benchmarks: a warm-up request, then one step per prompt
    list, one output token each, with transfer totals whenever a connector runs."""
    warmup = Step(prompts=[tinymodels.prompt_ids(2, CHUNK + 8)], max_tokens=1, logprobs=1)
    return InstanceSpec(
        model=model,
        block_size=BLOCK,
        max_model_len=prefix_tokens + 256,
        max_num_batched_tokens=CHUNK,
        connector=connector,
        steps=[
            warmup,
            *(
                Step(
                    prompts=list(prompts),
                    max_tokens=1,
                    logprobs=1,
                    transfer_totals=connector is not None,
                )
                for prompts in steps
            ),
        ],
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"
