"""hybridkv.integration: the vLLM KV connector reusing hybrid-model KV through Mooncake.

`HybridKVConnector` is imported lazily, so `import hybridkv.integration` works without
vLLM (for config validation and tooling).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "HybridKVConnector":
        from hybridkv.integration.connector import HybridKVConnector

        return HybridKVConnector
    raise AttributeError(f"module 'hybridkv.integration' has no attribute {name!r}")
