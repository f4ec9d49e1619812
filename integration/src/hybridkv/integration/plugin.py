"""vLLM general plugin: makes `kv_connector="HybridKVConnector"` work once installed."""

from __future__ import annotations

CONNECTOR_NAME = "HybridKVConnector"


def register() -> None:
    """Entry point of `vllm.general_plugins`; vLLM calls it in every process it starts."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "hybridkv.integration.connector", "HybridKVConnector"
    )
