"""Fixtures for the end-to-end suite: a real Mooncake pool, tiny models, cold references.

Every vLLM instance runs in its own process (``demo/vllm_instance.py``); the pool (a real
``mooncake_master`` plus a segment holder) lives for the whole session, so objects a
writer stored outlive it. The model builders and the instance runner are shared with the
demo and the benchmark; they live in ``demo/`` (scripts, not a package), which
``pytest.ini`` puts on the import path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinymodels
from scenario import COLD_PROMPTS, MAX_NUM_BATCHED_TOKENS, MODELS, Reference, Surgeon
from vllm_instance import InstanceSpec, Step, run_instance, write_pool_config

from hybridkv.transport import MasterProcess, MooncakeConfig, MooncakeStore, SegmentHolder
from hybridkv.transport.testing import require_real

pytest_plugins = ["hybridkv.transport.testing"]

HOLDER_SIZE = 512 << 20
INSTANCE_BUFFER = 64 << 20


class Pool:
    """The shared pool: where instances are pointed and how the test reaches objects."""

    def __init__(self, master: MasterProcess, config_path: Path, store: MooncakeStore):
        self.master = master
        self.config_path = config_path
        self.surgeon = Surgeon(store, self.http)

    @property
    def http(self) -> str:
        """The master's HTTP admin endpoint (key listing, replica queries)."""
        return f"{self.master.host}:{self.master.metrics_port}"


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    """vLLM and the connector must import; under HYBRIDKV_REQUIRE_REAL=1 a gap fails."""
    for module in ("vllm", "hybridkv.integration.connector"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            require_real(f"{module} is not installed")


@pytest.fixture(scope="session")
def pool(
    mooncake_master: MasterProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    """Master + a holder lending the memory; instances mount no segment of their own, so
    everything they store lands in the holder and survives them."""
    with SegmentHolder.start(mooncake_master.address, HOLDER_SIZE):
        config_path = write_pool_config(
            tmp_path_factory.mktemp("mooncake") / "mooncake.json", mooncake_master.address
        )
        store = MooncakeStore.connect(
            MooncakeConfig(
                master_server_address=mooncake_master.address,
                global_segment_size=0,
                local_buffer_size=INSTANCE_BUFFER,
            )
        )
        try:
            yield Pool(mooncake_master, config_path, store)
        finally:
            store.close()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def references(vllm_ready: None, models_dir: Path, runs_dir: Path) -> dict[str, Reference]:
    """Cold outputs (no connector) of every scenario prompt, one process per model, lazily."""
    return _ReferenceCache(models_dir, runs_dir)


class _ReferenceCache(dict[str, Reference]):
    def __init__(self, models_dir: Path, runs_dir: Path) -> None:
        super().__init__()
        self._models_dir = models_dir
        self._runs_dir = runs_dir

    def __missing__(self, model: str) -> Reference:
        built = tinymodels.build(model, self._models_dir, **MODELS[model])
        spec = InstanceSpec(
            model=str(built.path),
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            steps=[Step(prompts=list(COLD_PROMPTS.values()))],
            report_kv_groups=True,
        )
        result = run_instance(
            spec, self._runs_dir, f"cold-{model}", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        )
        reference = Reference(
            model_path=built.path,
            outputs=dict(zip(COLD_PROMPTS, result.steps[0].prompts, strict=True)),
            kv_groups=result.kv_groups or [],
        )
        self[model] = reference
        return reference
