"""The Kubernetes manifests in docs/deploy/k8s say what hybridkv accepts.

Their schema is checked by `kubernetes-validate` in the lint session; here the settings
inside them go through hybridkv's own parsers, and the addresses agree across them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.integration.config import mooncake_config_from_env, parse_extra_config
from hybridkv.transport import parse_size

yaml = pytest.importorskip("yaml")  # PyYAML comes with vLLM

MANIFESTS = Path(__file__).resolve().parents[2] / "docs" / "deploy" / "k8s"


def resources(name: str) -> dict[str, dict[str, Any]]:
    """The manifest's resources by kind/name."""
    documents = yaml.safe_load_all((MANIFESTS / name).read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in documents if d}


def container(resource: dict[str, Any], name: str) -> dict[str, Any]:
    spec = resource["spec"]["template"]["spec"]
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def master_endpoint() -> str:
    service = resources("master.yaml")["Service/mooncake-master"]
    (rpc,) = [port for port in service["spec"]["ports"] if port["name"] == "rpc"]
    return f"{service['metadata']['name']}:{rpc['port']}"


def test_the_vllm_pods_config_files_parse_and_name_the_master(tmp_path: Path) -> None:
    config_map = resources("vllm.yaml")["ConfigMap/hybridkv-config"]["data"]
    path = tmp_path / "mooncake.json"
    path.write_text(config_map["mooncake.json.template"].replace("POD_IP", "10.0.0.5"))
    mooncake = mooncake_config_from_env({"MOONCAKE_CONFIG_PATH": str(path)})
    assert mooncake is not None
    assert mooncake.master_server_address == master_endpoint()
    assert mooncake.local_hostname == "10.0.0.5"
    assert mooncake.global_segment_size == 0  # the pods' KV lives in the holders
    transfer = json.loads(config_map["kv-transfer-config.json"])
    assert transfer["kv_connector"] == "HybridKVConnector"
    assert transfer["kv_load_failure_policy"] == "recompute"
    parse_extra_config(transfer["kv_connector_extra_config"])  # raises on a bad key


def test_the_holders_join_the_master_with_their_nodes_address() -> None:
    holder = container(resources("holder.yaml")["DaemonSet/hybridkv-holder"], "holder")
    args = dict(arg.lstrip("-").split("=", 1) for arg in holder["args"])
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in holder["env"]}
    assert args["master"] == master_endpoint()
    assert args["hostname"] == "$(NODE_IP)"
    # its probes reach /health where it serves it, on the node's address
    assert args["http-host"] == args["hostname"]
    (port,) = holder["ports"]
    assert args["http-port"] == str(port["containerPort"])
    for probe in ("startupProbe", "readinessProbe"):
        assert holder[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert env["MC_TCP_BIND_ADDRESS"] == env["NODE_IP"]  # advertised where it listens
    segment = parse_size(env["SEGMENT_SIZE"], "SEGMENT_SIZE")
    limit = parse_size(holder["resources"]["limits"]["memory"].replace("Gi", "GiB"), "limit")
    assert segment < limit  # the pod may hold its whole segment
