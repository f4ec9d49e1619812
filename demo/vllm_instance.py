"""One vLLM instance in its own process: run prompts, report tokens, logprobs and hits.

Each instance must be a separate OS process (that is what sharing a prefix across
instances means, and it proves the stored objects outlive their writer), so the parent
writes an :class:`InstanceSpec` to JSON, runs ``python vllm_instance.py SPEC RESULT``,
and reads an :class:`InstanceResult` back. :func:`run_instance` does all of that and
stops every process the child started, whatever happens.

External hit tokens are read from vLLM itself: the scheduler's
``vllm:external_prefix_cache_hits`` counter (tokens the KV connector promised and the
scheduler accepted), sampled before and after each prompt. The local prefix cache is
reset before each prompt so that a local hit cannot hide an external one.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from hybridkv.integration.cli.master_http import MasterHttp

CONNECTOR_NAME = "HybridKVConnector"
CONNECTOR_MODULE = "hybridkv.integration"
EXTERNAL_HITS_METRIC = "vllm:external_prefix_cache_hits"
T = TypeVar("T")
R = TypeVar("R", bound=msgspec.Struct)


class Step(msgspec.Struct, kw_only=True):
    """Prompts run one at a time, in order (one request per ``generate`` call)."""

    prompts: list[list[int]]
    max_tokens: int = 4
    logprobs: int = 5
    snapshot_keys: bool = False  # list the pool's keys once the stores have settled
    # drop the local prefix cache before each prompt, so only the connector can give hits
    reset_prefix_cache: bool = True
    # report the connector's transfer totals of each prompt (needs the in-process engine)
    transfer_totals: bool = False
    # vLLM counters (by `get_metrics()` name, e.g. "vllm:hybridkv_lookup_seconds") whose
    # increase over each prompt PromptResult.counters reports
    counters: list[str] = msgspec.field(default_factory=list)
    # before the prompts, reset the connector's cache as after a weight update
    # (reset_prefix_cache(reset_connector=True)); StepResult.reset_ok is vLLM's answer
    reset_connector: bool = False


class InstanceSpec(msgspec.Struct, kw_only=True):
    model: str
    block_size: int = 32
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    # On the CPU backend this is the share of RAM that must be free at start-up; the KV
    # cache itself is sized by VLLM_CPU_KVCACHE_SPACE.
    memory_utilization: float = 0.2
    # kv_connector_extra_config of the connector; None: no connector at all
    connector: dict[str, Any] | None = None
    # the connector class by vLLM's registered name; another than hybridkv's (e.g. vLLM's
    # reference ExampleConnector) serves as an oracle for what a load must produce
    connector_class: str = CONNECTOR_NAME
    # vLLM's kv_role of the connector: "kv_consumer" with `consumer_is_to_load` in
    # `connector` loads and never stores
    kv_role: str = "kv_both"
    # master's HTTP admin address (host:port), needed by Step.snapshot_keys
    master_http: str | None = None
    steps: list[Step] = msgspec.field(default_factory=list)
    # report the KV cache group kinds by vLLM group id (in-process engines only)
    report_kv_groups: bool = False
    # >1: one worker process per rank (vLLM's "mp" executor)
    tensor_parallel_size: int = 1
    # >1: pipeline stages, each its own worker processes (vllm-cpu allocates the buffers
    # between stages only when it compiles the model: such instances are not eager)
    pipeline_parallel_size: int = 1
    dtype: str = "float32"  # vLLM-cpu's GDN (Qwen3-Next) runs in bfloat16 only
    # vLLM's prefix_match_unit: its prefix cache (and the connector's prompt tails) hit at
    # multiples of it inside blocks; None: vLLM's default
    prefix_match_unit: int | None = None
    # vLLM's speculative_config (e.g. an EAGLE draft head); None: no speculative decoding
    speculative_config: dict[str, Any] | None = None
    # vLLM's attention backend by name (e.g. "CPU_MLA"); None: vLLM's choice, which on
    # CPUs with AMX is its AMX MLA kernel for MLA models (bfloat16 weights only)
    attention_backend: str | None = None
    # "module:function" called before vLLM starts (a test's stand-in for kernels vllm-cpu
    # lacks), in this process only: the engine must run in it
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0); the module must be importable (demo/ is)
    prepare: str | None = None


class PromptResult(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    # per generated position: (token id, logprob) of the top-k plus the sampled token
    logprobs: list[list[tuple[int, float]]]
    num_cached_tokens: int
    external_hit_tokens: int
    first_token_latency_s: float
    wall_s: float
    # the connector's counters summed over this prompt (Step.transfer_totals)
    transfer: dict[str, float] | None = None
    # the increase of each of Step.counters over this prompt
    counters: dict[str, float] = msgspec.field(default_factory=dict)


def write_pool_config(
    path: Path,
    master_address: str,
    local_buffer_size: int = 64 << 20,
    local_hostname: str = "127.0.0.1",
) -> Path:
    """The `MOONCAKE_CONFIG_PATH` file of instances that lend the pool no memory: a segment
    holder keeps what they store, so it outlives them. vLLM's MooncakeStoreConnector reads
    the same file ("standalone-store" is its name for that topology). `local_hostname`:
    the address other hosts reach the instance at."""
    config = {
        "master_server_address": master_address,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": local_hostname,
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": local_buffer_size,
    }
    path.write_text(json.dumps(config))
    return path


def logprob_gap(a: PromptResult, b: PromptResult) -> float:
    """Largest logprob difference over tokens both runs report (inf if tokens differ, or
    either run has a NaN logprob)."""
    if a.token_ids != b.token_ids:
        return float("inf")
    gap = 0.0
    for position_a, position_b in zip(a.logprobs, b.logprobs, strict=True):
        other = dict(position_b)
        if set(dict(position_a)) != set(other):
            return float("inf")
        for token, logprob in position_a:
            # equal covers -inf in both; NaN in either differs from everything
            difference = 0.0 if logprob == other[token] else abs(logprob - other[token])
            if math.isnan(difference):
                return float("inf")
            gap = max(gap, difference)
    return gap


class StepResult(msgspec.Struct, kw_only=True):
    prompts: list[PromptResult]
    keys: list[str] | None = None
    reset_ok: bool | None = None


class InstanceResult(msgspec.Struct, kw_only=True):
    load_s: float
    steps: list[StepResult]
    # vLLM's KVCacheSpec class name of each KV cache group, by group id
    kv_groups: list[str] | None = None


class InstanceError(RuntimeError):
    """The child exited badly or ran out of time; the message carries its log tail, `log`
    names the whole log (a reason logged early may be past the tail)."""

    def __init__(self, message: str, log: Path) -> None:
        super().__init__(message)
        self.log = log


# -- parent side ------------------------------------------------------------------------


def run_instance(
    spec: InstanceSpec,
    workdir: Path,
    name: str,
    env: dict[str, str],
    timeout_s: float = 600.0,
    launcher: Sequence[str] = (),
) -> InstanceResult:
    """Run ``spec`` in a fresh process group; raise :class:`InstanceError` on any error.
    `launcher`: a command prefix the instance runs under (e.g. `ip netns exec HOST`)."""
    return run_script(Path(__file__), spec, InstanceResult, workdir, name, env, timeout_s, launcher)


def run_script(
    script: Path,
    spec: msgspec.Struct,
    result_type: type[R],
    workdir: Path,
    name: str,
    env: dict[str, str],
    timeout_s: float = 600.0,
    launcher: Sequence[str] = (),
) -> R:
    """Run ``python script SPEC RESULT`` (under `launcher`) in a fresh process group and
    decode its RESULT; raise :class:`InstanceError` on any error."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"{name}.spec.json"
    result_path = workdir / f"{name}.result.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_bytes(msgspec.json.encode(spec))
    result_path.unlink(missing_ok=True)
    argv = [*launcher, sys.executable, str(script.resolve()), str(spec_path), str(result_path)]
    child = start_group(argv, log_path, env)
    try:
        code: int | None = child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop_group(child)
    if code != 0 or not result_path.exists():
        why = "timed out" if code is None else f"exited with {code}"
        raise InstanceError(
            f"vLLM instance {name!r} {why}; log {log_path}:\n{_tail(log_path)}", log_path
        )
    return msgspec.json.decode(result_path.read_bytes(), type=result_type)


def start_group(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`argv` leading a new process group (vLLM's engine-core and worker children join
    it), its output in `log_path`, `env` over this process's environment."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def stop_group(child: subprocess.Popen[bytes]) -> None:
    """Kill whatever is left of the group led by our child (vLLM's engine-core process)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


_GLOG_LINE = re.compile(r"^[IWEF]\d{4} ")  # Mooncake's chatter, noise in a failure report


def _tail(path: Path, lines: int = 25) -> str:
    kept = [
        line for line in path.read_text(errors="replace").splitlines() if not _GLOG_LINE.match(line)
    ]
    return "\n".join(kept[-lines:])


def list_pool_keys(master_http: str) -> list[str]:
    """Every key the master knows, from its HTTP admin endpoint."""
    return MasterHttp(master_http).list_keys()


# -- child side -------------------------------------------------------------------------


def _counters(names: Sequence[str]) -> dict[str, float]:
    """The value of each named counter, summed over its labels (0 if vLLM has none).
    Read from the Prometheus registry of this process (where vLLM's stat loggers run):
    `LLM.get_metrics()` truncates counters to whole numbers, seconds included."""
    from prometheus_client import REGISTRY

    values = dict.fromkeys(names, 0.0)
    for metric in REGISTRY.collect():
        if metric.name in values:
            total = f"{metric.name}_total"
            values[metric.name] += sum(s.value for s in metric.samples if s.name == total)
    return values


def _external_hits(llm: Any) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == EXTERNAL_HITS_METRIC))


def _kv_groups(llm: Any) -> list[str]:
    """The spec kinds of the engine's KV cache groups; needs the in-process engine."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("report_kv_groups needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    return [type(group.kv_cache_spec).__name__ for group in groups]


def settled(read: Callable[[], T], quiet_s: float, timeout_s: float, poll_s: float) -> T:
    """What `read` returns once it has stopped changing for `quiet_s` (or at `timeout_s`):
    the pool's keys, a server's counters, which asynchronous work updates after a reply."""
    value = read()
    changed = time.monotonic()
    deadline = changed + timeout_s
    while time.monotonic() - changed < quiet_s and time.monotonic() < deadline:
        time.sleep(poll_s)
        now = read()
        if now != value:
            value, changed = now, time.monotonic()
    return value


def _settled_keys(master_http: str) -> list[str]:
    """Keys once the listing has stopped changing for a second (stores are async)."""
    return settled(lambda: list_pool_keys(master_http), quiet_s=1.0, timeout_s=30.0, poll_s=0.1)


def _transfer_totals() -> dict[str, float]:
    """The in-process connector's counters since the last call (then reset)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector: Any = get_kv_transfer_group()  # hybridkv's HybridKVConnector
    totals: dict[str, float] = connector.transfer_totals(reset=True)
    return totals


def top_logprobs(positions: Any) -> list[list[tuple[int, float]]]:
    """vLLM's logprobs of generated positions as `PromptResult.logprobs` holds them."""
    return [
        sorted((int(token), float(lp.logprob)) for token, lp in position.items())
        for position in positions or []
    ]


def _run_prompt(llm: Any, prompt: list[int], step: Step) -> PromptResult:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=step.max_tokens, logprobs=step.logprobs)
    # Refused while blocks are held: the request would then hit vLLM's own cache.
    if step.reset_prefix_cache and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to empty its prefix cache")
    if step.transfer_totals:
        _transfer_totals()
    hits_before = _external_hits(llm)
    counters_before = _counters(step.counters)
    started = time.perf_counter()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    wall = time.perf_counter() - started
    transfer = _transfer_totals() if step.transfer_totals else None
    counters = {
        name: value - counters_before[name] for name, value in _counters(step.counters).items()
    }
    completion = output.outputs[0]
    metrics = output.metrics
    return PromptResult(
        token_ids=list(completion.token_ids),
        logprobs=top_logprobs(completion.logprobs),
        num_cached_tokens=int(output.num_cached_tokens or 0),
        external_hit_tokens=_external_hits(llm) - hits_before,
        first_token_latency_s=float(getattr(metrics, "first_token_latency", 0.0) or 0.0),
        wall_s=wall,
        transfer=transfer,
        counters=counters,
    )


def _build_llm(spec: InstanceSpec) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if spec.connector is not None:
        transfer = KVTransferConfig(
            kv_connector=spec.connector_class,
            kv_connector_module_path=(
                CONNECTOR_MODULE if spec.connector_class == CONNECTOR_NAME else None
            ),
            kv_role=spec.kv_role,
            kv_connector_extra_config=spec.connector,
        )
    return LLM(
        model=spec.model,
        dtype=spec.dtype,
        enforce_eager=spec.pipeline_parallel_size == 1,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        gpu_memory_utilization=spec.memory_utilization,
        enable_prefix_caching=True,
        disable_log_stats=False,  # the external-hit counter lives in the stats
        kv_transfer_config=transfer,
        seed=0,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        distributed_executor_backend=(
            "mp" if spec.tensor_parallel_size * spec.pipeline_parallel_size > 1 else None
        ),
        prefix_match_unit=spec.prefix_match_unit,
        speculative_config=spec.speculative_config,
        attention_backend=spec.attention_backend,
    )


def main(spec_path: str, result_path: str) -> int:
    spec = msgspec.json.decode(Path(spec_path).read_bytes(), type=InstanceSpec)
    if spec.prepare is not None:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise ValueError("prepare patches this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        module, function = spec.prepare.split(":")
        getattr(importlib.import_module(module), function)()
    started = time.perf_counter()
    llm = _build_llm(spec)
    load_s = time.perf_counter() - started
    kv_groups = _kv_groups(llm) if spec.report_kv_groups else None
    steps: list[StepResult] = []
    for step in spec.steps:
        reset_ok = llm.reset_prefix_cache(reset_connector=True) if step.reset_connector else None
        prompts = [_run_prompt(llm, prompt, step) for prompt in step.prompts]
        keys = None
        if step.snapshot_keys:
            if spec.master_http is None:
                raise ValueError("snapshot_keys needs master_http")
            keys = _settled_keys(spec.master_http)
        steps.append(StepResult(prompts=prompts, keys=keys, reset_ok=reset_ok))
    del llm  # shut the engine down (and its connector) before reporting success
    gc.collect()
    result = InstanceResult(load_s=load_s, steps=steps, kv_groups=kv_groups)
    Path(result_path).write_bytes(msgspec.json.encode(result))
    print(json.dumps({"ok": True, "steps": len(steps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
