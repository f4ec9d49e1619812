"""Fake of vllm_ascend/attention/utils.py: the connector calls its attention paths make."""

from __future__ import annotations

from typing import Any

from fakes import ascend_runtime


def wait_for_kv_layer_from_connector(layer_name: str) -> None:
    if ascend_runtime.connector is None:
        return
    ascend_runtime.trace.append(f"connector_wait:{layer_name}")
    ascend_runtime.connector.wait_for_layer_load(layer_name)


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: list[Any]) -> None:
    if ascend_runtime.connector is None:
        return
    ascend_runtime.trace.append(f"connector_save:{layer_name}")
    ascend_runtime.connector.save_kv_layer(layer_name, kv_cache_layer, None)


def notify_kv_cache_written(layer_name: str = "") -> None:
    ascend_runtime.trace.append(f"notify_written:{layer_name}")
