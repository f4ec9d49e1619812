"""The `hybridkv` command against a real Mooncake master holding real objects."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybridkv.integration.cli import main
from hybridkv.integration.cli.master_http import MasterHttp
from hybridkv.keys import HybridKey
from hybridkv.transport import MasterProcess, MooncakeStore, SegmentHolder, Status
from hybridkv.transport.master import LOOPBACK, free_port

pytest_plugins = ["hybridkv.transport.testing"]

LAYOUT = "abc123"
OTHER_LAYOUT = "def456"


def hybrid(model: str, group: int, block_hash: str, layout: str = LAYOUT) -> str:
    return str(HybridKey(model, layout, group, 16, block_hash, 0))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    status, out, err = run(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def pool(
    mooncake_master: MasterProcess,
    segment_holder: SegmentHolder,
    shared_mooncake_store: MooncakeStore,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, str]:
    """The session's pool, a Mooncake config naming it, and its admin endpoint."""
    config = tmp_path_factory.mktemp("cli") / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "master_server_address": mooncake_master.address,
                "global_segment_size": 0,
                "local_buffer_size": "16MB",
                "local_hostname": LOOPBACK,
            }
        )
    )
    return config, f"{mooncake_master.host}:{mooncake_master.metrics_port}"


@pytest.fixture(scope="module")
def put(shared_mooncake_store: MooncakeStore) -> Iterator[Any]:
    """Stores objects of given sizes under given keys (bytes from one registered buffer);
    removes what is left of them afterwards, so later modules find the session pool as it was."""
    buffer = np.arange(1 << 16, dtype=np.uint8)
    shared_mooncake_store.register_buffer(buffer.ctypes.data, buffer.size)
    stored: list[str] = []

    def put(objects: dict[str, int]) -> None:
        keys = list(objects)
        stored.extend(keys)
        statuses = shared_mooncake_store.batch_put_whole(
            keys, [[buffer.ctypes.data]] * len(keys), [[objects[key]] for key in keys]
        )
        assert statuses == [Status.OK] * len(keys)

    yield put
    shared_mooncake_store.batch_remove(stored, force=True)
    shared_mooncake_store.unregister_buffer(buffer.ctypes.data)


def pool_args(pool: tuple[Path, str]) -> list[str]:
    config, admin = pool
    return ["--mooncake-config", str(config), "--master-http", admin]


# -- without a pool -------------------------------------------------------------------


def test_the_command_imports_neither_vllm_nor_torch() -> None:
    probe = (
        "import sys; from hybridkv.integration.cli import build_parser; build_parser(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "hybridkv.integration.cli", "--help"],
        capture_output=True,
        text=True,
    )
    assert helped.returncode == 0
    for command in ("doctor", "pool", "keys"):
        assert command in helped.stdout


def test_keys_explain_prints_fields_and_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "keys", "explain", "llama~prod@0a1b@3")
    assert status == 0
    assert "single-group" in out
    assert "0a1b" in out
    assert out.rstrip().endswith("namespace   prod")
    [entry] = run_json(capsys, "keys", "explain", hybrid("gemma", 2, "ff"))
    assert entry["format"] == "hybrid"
    assert entry["fields"]["group"] == 2
    assert entry["fields"]["layout"] == LAYOUT
    assert entry["owner"]["namespace"] is None


def test_a_bad_key_is_bad_input_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    status, _out, err = run(capsys, "keys", "explain", "m@mooncake_hybrid_v1:x@group:y@1@2@3")
    assert status == 2
    assert err.startswith("hybridkv: error: invalid key")
    assert "group" in err
    assert "Traceback" not in err


def test_a_pool_command_without_a_pool_is_bad_input(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    status, _, err = run(capsys, "pool", "ls")
    assert status == 2
    assert "--master-http" in err
    broken = tmp_path / "mooncake.json"
    broken.write_text('{"master_server_address": "nowhere"}')
    status, _, err = run(capsys, "pool", "status", "--mooncake-config", str(broken))
    assert status == 2
    assert "host:port" in err


def test_an_unreachable_master_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    nobody = f"{LOOPBACK}:{free_port()}"
    for command in (["pool", "status"], ["pool", "du"], ["pool", "ls"]):
        status, _out, err = run(capsys, *command, "--master-http", nobody)
        assert status == 1, command
        assert err.count("\n") == 1
        assert nobody in err
        assert "Traceback" not in err


# -- against the real pool ------------------------------------------------------------


def test_status_counts_segments_capacity_and_objects(
    capsys: pytest.CaptureFixture[str], pool: tuple[Path, str], put: Any
) -> None:
    put({"status-model@aa@0": 1000})
    status = run_json(capsys, "pool", "status", *pool_args(pool))
    assert status["ready"]
    assert status["master_rpc_listening"]
    assert status["segments"]
    assert status["capacity_bytes"] >= 64 << 20
    assert status["used_bytes"] >= 1000
    assert status["objects"] == len(MasterHttp(pool[1]).list_keys())
    code, out, _ = run(capsys, "pool", "status", *pool_args(pool))
    assert code == 0
    assert "capacity" in out
    assert "serving" in out


def test_ls_and_du_sum_objects_and_bytes_per_owner(
    capsys: pytest.CaptureFixture[str], pool: tuple[Path, str], put: Any
) -> None:
    put(
        {
            "du-model@aa@0": 100,
            "du-model@bb@0": 200,
            "du-model~prod@aa@0": 300,
            hybrid("du-hybrid", 0, "aa"): 1000,
            hybrid("du-hybrid", 1, "aa"): 2000,
            hybrid("du-hybrid", 1, "bb"): 4000,
            "not-a-hybridkv-key": 50,
        }
    )
    listed = run_json(capsys, "pool", "ls", "--model", "/models/du-model", *pool_args(pool))
    assert {item["key"]: item["bytes"] for item in listed} == {
        "du-model@aa@0": 100,
        "du-model@bb@0": 200,
        "du-model~prod@aa@0": 300,
    }
    code, out, _ = run(
        capsys, "pool", "ls", "--model", "du-hybrid", "--group", "1", *pool_args(pool)
    )
    assert code == 0
    assert out.split() == [hybrid("du-hybrid", 1, "aa"), hybrid("du-hybrid", 1, "bb")]

    rows = run_json(capsys, "pool", "du", "--model", "du-hybrid", *pool_args(pool))
    assert [(r["owner"]["group"], r["objects"], r["bytes"]) for r in rows] == [
        (0, 1, 1000),
        (1, 2, 6000),
    ]
    rows = run_json(
        capsys, "pool", "du", "--model", "du-model", "--by", "namespace", *pool_args(pool)
    )
    assert {r["owner"]["namespace"]: (r["objects"], r["bytes"]) for r in rows} == {
        "": (2, 300),
        "prod": (1, 300),
    }
    rows = run_json(capsys, "pool", "du", "--by", "model", *pool_args(pool))
    by_model = {(r["owner"]["format"], r["owner"]["model"]): r["objects"] for r in rows}
    assert by_model[("hybrid", "du-hybrid")] == 3
    assert by_model[("single-group", "du-model")] == 3
    assert by_model[("foreign", "")] >= 1
    code, out, _ = run(capsys, "pool", "du", "--model", "du-hybrid", *pool_args(pool))
    assert code == 0
    assert "du-hybrid" in out
    assert "total: 3 objects, 6.8 KiB" in out


def test_evict_removes_exactly_the_chosen_model_and_namespace(
    capsys: pytest.CaptureFixture[str], pool: tuple[Path, str], put: Any
) -> None:
    mine = {"ev~prod@aa@0": 100, "ev~prod@bb@1": 100}
    others = {
        "ev@aa@0": 100,  # the default namespace
        "ev~staging@aa@0": 100,
        "ev~prod2@aa@0": 100,
        "evx~prod@aa@0": 100,  # another model whose name begins alike
        hybrid("ev", 0, "aa"): 100,
        "ev~prod-not-a-key": 100,
    }
    put({**mine, **others})
    admin = MasterHttp(pool[1])

    plan = run_json(
        capsys,
        "pool",
        "evict",
        "--model",
        "ev",
        "--namespace",
        "prod",
        "--dry-run",
        *pool_args(pool),
    )
    assert plan["dry_run"]
    assert sorted(plan["removed"]) == sorted(mine)
    assert plan["hybrid_not_selected"] == 1
    assert set(mine) <= set(admin.list_keys())

    code, out, _ = run(
        capsys, "pool", "evict", "--model", "ev", "--namespace", "prod", "-v", *pool_args(pool)
    )
    assert code == 0
    assert out.startswith("removed 2 objects (200 B)")
    assert all(key in out for key in mine)
    assert "--layout" in out  # says why the hybrid object stayed
    left = set(admin.list_keys())
    assert not set(mine) & left
    assert set(others) <= left

    report = run_json(
        capsys, "pool", "evict", "--model", "ev", "--layout", LAYOUT, *pool_args(pool)
    )
    assert report["removed"] == [hybrid("ev", 0, "aa")]
    report = run_json(capsys, "pool", "evict", "--model", "ev", "--namespace", "", *pool_args(pool))
    assert report["removed"] == ["ev@aa@0"]
    left = set(admin.list_keys())
    assert {"ev~staging@aa@0", "ev~prod2@aa@0", "evx~prod@aa@0", "ev~prod-not-a-key"} <= left


def test_evict_without_a_client_config_is_bad_input(
    capsys: pytest.CaptureFixture[str],
    pool: tuple[Path, str],
    put: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    put({"noconf@aa@0": 100})
    status, _, err = run(capsys, "pool", "evict", "--model", "noconf", "--master-http", pool[1])
    assert status == 2
    assert "--mooncake-config" in err
    assert "noconf@aa@0" in MasterHttp(pool[1]).list_keys()


# -- doctor ---------------------------------------------------------------------------

GOOD_TRANSFER = json.dumps(
    {
        "kv_connector": "HybridKVConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"use_layerwise": True, "namespace": "prod"},
    }
)


def test_doctor_passes_a_ready_pool_and_says_what_would_happen(
    capsys: pytest.CaptureFixture[str], pool: tuple[Path, str]
) -> None:
    report = run_json(capsys, "doctor", "--kv-transfer-config", GOOD_TRANSFER, *pool_args(pool))
    assert report["exit_status"] == 0
    assert {check["name"]: check["outcome"] for check in report["checks"]} == {
        "mooncake config": "ok",
        "kv-transfer-config": "ok",
        "mooncake client": "ok",
        "master rpc": "ok",
        "master admin": "ok",
    }
    assert "hybridkv-integration" in report["versions"]
    assert any("layer by layer" in line for line in report["plan"])
    assert any("'prod'" in line for line in report["plan"])


def test_doctor_names_bad_settings_with_exit_2(
    capsys: pytest.CaptureFixture[str], pool: tuple[Path, str], tmp_path: Path
) -> None:
    transfer = tmp_path / "transfer.json"
    transfer.write_text(
        json.dumps(
            {
                "kv_connector": "HybridKVConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"use_layerwize": True},
            }
        )
    )
    status, out, err = run(
        capsys, "doctor", "--kv-transfer-config", str(transfer), *pool_args(pool)
    )
    assert status == 2
    assert "use_layerwize" in out
    assert not err
    status, out, _ = run(
        capsys, "doctor", "--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'
    )
    assert status == 2
    assert "not hybridkv's connector" in out


def test_doctor_reports_an_unreachable_master_with_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_server_address": f"{LOOPBACK}:{free_port()}"}))
    nobody = f"{LOOPBACK}:{free_port()}"
    status, out, _ = run(
        capsys,
        "doctor",
        "--mooncake-config",
        str(config),
        "--master-http",
        nobody,
        "--kv-transfer-config",
        GOOD_TRANSFER,
    )
    assert status == 1
    assert "fail  master rpc" in out
    assert "does not accept connections" in out
