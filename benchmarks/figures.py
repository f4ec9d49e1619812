"""How the vLLM benchmarks summarise their requests: medians, printed in milliseconds."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from vllm_instance import PromptResult


def median(values: Iterable[float]) -> float:
    """The median, nan for no values (a run that measured nothing prints as such)."""
    collected = list(values)
    return statistics.median(collected) if collected else float("nan")


def ttft(prompts: Sequence[PromptResult]) -> float:
    """vLLM's own time to first token, median over the requests, in seconds."""
    return median(p.first_token_latency_s for p in prompts)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"
