"""Shared builders: real vLLM spec objects and request/output stand-ins for the scheduler.

The real-vLLM tests' tiny models are the demo's (`demo/tinymodels.py`: a script beside
the demo, not a package), so `demo/` goes on the import path here.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import settings

from hybridkv.transport.testing import real_required

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demo"))
# Hypothesis' per-example deadline is a timed assertion: on shared, loaded cores it fails
# examples that are slow, not wrong (seen under load). Speed is the benchmarks' business.
settings.register_profile("hybridkv", deadline=None)
settings.load_profile("hybridkv")


def require(module: str) -> ModuleType:
    """`module`, imported; without it the test (or the test module) is skipped, or fails
    under HYBRIDKV_REQUIRE_REAL=1 (CI: nothing that needs vLLM may skip there)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if real_required():
            raise
        pytest.skip(f"{module} is not installed: {exc}", allow_module_level=True)


@pytest.fixture
def vllm_specs() -> Any:
    require("vllm")
    from vllm.v1 import kv_cache_interface

    return kv_cache_interface


def attention(specs: Any, block_size: int = 32, heads: int = 2, window: int | None = None) -> Any:
    import torch

    common = dict(block_size=block_size, num_kv_heads=heads, head_size=64, dtype=torch.float32)
    if window is None:
        return specs.FullAttentionSpec(**common)
    return specs.SlidingWindowSpec(sliding_window=window, **common)


def mamba(specs: Any, block_size: int = 32, mode: str = "align", **extra: Any) -> Any:
    import torch

    return specs.MambaSpec(
        block_size=block_size,
        shapes=((2, 128),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        **extra,
    )


def groups(specs: Any, *kinds: tuple[list[str], Any]) -> list[Any]:
    return [specs.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in kinds]


def model_config(heads: int = 2, **fields: Any) -> SimpleNamespace:
    """The fields of vLLM's ModelConfig that plan_from_vllm reads."""
    import torch

    defaults: dict[str, Any] = dict(
        model="",
        model_weights="",
        revision=None,
        code_revision=None,
        quantization=None,
        quantization_config=None,
        dtype=torch.bfloat16,
        hf_overrides={},
        get_total_num_kv_heads=lambda: heads,
        get_total_num_hidden_layers=lambda: 1,
    )
    return SimpleNamespace(**{**defaults, **fields})


def request(request_id: str, tokens: list[int], **extra: Any) -> SimpleNamespace:
    """The fields of vllm.v1.request.Request the scheduler side reads."""
    fields: dict[str, Any] = dict(
        request_id=request_id,
        num_tokens=len(tokens),
        num_prompt_tokens=len(tokens),
        num_computed_tokens=0,
        all_token_ids=tokens,
        prompt_embeds=None,
        lora_request=None,
        cache_salt=None,
        mm_features=[],
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


def scheduler_output(
    new: list[tuple[str, tuple[list[int], ...], int, int]] = (),  # type: ignore[assignment]
    cached: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
    tables: dict[str, tuple[list[int], ...]] | None = None,
    finished: set[str] | None = None,
    resumed: list[tuple[str, tuple[list[int], ...], int, int]] = (),  # type: ignore[assignment]
    order: list[str] | None = None,
) -> SimpleNamespace:
    """new and resumed (after preemption): (id, block_ids, computed, scheduled);
    cached: (id, computed, scheduled). vLLM schedules the running requests first, then
    the waiting ones (resumed and new) in `order` (default: resumed first)."""
    scheduled = {rid: count for rid, _, count in cached}
    waiting = {rid: count for rid, _, _, count in [*resumed, *new]}
    scheduled.update({rid: waiting[rid] for rid in order or waiting})
    state = None
    if tables is not None:
        state = SimpleNamespace(get_block_ids=lambda rid: tables.get(rid))
    return SimpleNamespace(
        finished_req_ids=finished or set(),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=ids, num_computed_tokens=computed)
            for rid, ids, computed, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid for rid, _, _ in cached] + [rid for rid, _, _, _ in resumed],
            resumed_req_ids={rid for rid, _, _, _ in resumed},
            new_block_ids=[None for _ in cached] + [ids for _, ids, _, _ in resumed],
            num_computed_tokens=[computed for _, computed, _ in cached]
            + [computed for _, _, computed, _ in resumed],
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        kv_connector_block_state=state,
    )


class Clock:
    """A settable clock for code that takes one (the quarantine's)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
