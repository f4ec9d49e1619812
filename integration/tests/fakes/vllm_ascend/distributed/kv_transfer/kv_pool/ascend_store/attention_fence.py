"""Fake of ascend_store/attention_fence.py: the attention-start fence vllm-ascend records."""

from fakes import ascend_runtime


def record_attention_compute_start() -> None:
    ascend_runtime.trace.append("attention_fence")
