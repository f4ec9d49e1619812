"""Fake of vllm_ascend/device/device_op.py: the device adaptor that hands out the DSA op."""

from __future__ import annotations

from typing import Any

from fakes import ascend_runtime


def _npu_sparse_attn_sharedkv(q: Any, **kwargs: Any) -> tuple[Any, ...]:
    layer, cache, metadata = kwargs["ori_kv"]
    ascend_runtime.attention(layer, cache, metadata)
    return (q,)


class BaseDeviceAdaptor:
    @staticmethod
    def get_dsa_sparse_attn_op() -> Any:
        """Returns the sparse attention operator."""
        return _npu_sparse_attn_sharedkv

    @staticmethod
    def get_dsa_sparse_attn_base_kwargs() -> dict[str, Any]:
        return {}


DeviceOperator: type[BaseDeviceAdaptor] = BaseDeviceAdaptor
