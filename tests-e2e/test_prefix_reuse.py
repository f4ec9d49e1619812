"""A prefix stored by one vLLM process is reused by another, with identical output.

For each model (one KV group; sliding window + full attention; conv state + full
attention) and each transfer pairing, a writer instance runs its prompts and exits; the
test then tampers with the pool through the store API; a reader instance started
afterwards runs the scenario's prompts, each lookup searching the hit boundary as a long
prompt's does. The checks compare the reader with a cold run (no connector) of the same
prompts, and the negative controls show the checks can fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    BLOCK,
    EXPECTED_HITS,
    LOGPROB_TOLERANCE,
    MAX_NUM_BATCHED_TOKENS,
    MODELS,
    READER_PROMPTS,
    WRITER_STEPS,
    Reference,
    changed,
    group_of,
    keys_added_by_step,
    logprob_gap,
)
from vllm_instance import InstanceSpec, PromptResult, Step, list_pool_keys, run_instance

HYBRID_MODELS = [name for name in MODELS if name != "llama"]
FULL_ATTENTION = "FullAttentionSpec"


Case = tuple[str, str, str, str]  # model, writer mode, reader mode, multiprocessing

# Transfer mode -> connector keys: the staged default (host caches) whole or layerwise, and
# the granularities device caches get, run here on host caches: per-layer ranges in put
# and get sessions ("ranged"), one multi-buffer call per group ("group").
MODES: dict[str, dict[str, object]] = {
    "whole": {"use_layerwise": False},
    "layerwise": {"use_layerwise": True},
    "ranged": {"use_layerwise": True, "granularity": "layer"},
    "group": {"use_layerwise": True, "granularity": "group"},
}

# VLLM_ENABLE_V1_MULTIPROCESSING is that of both instances. Every model crosses the modes
# both ways, so each mode writes and reads every layout; each direction runs with the
# engine in-process and in its own process; the conv-state model, the hardest layout, also
# runs each mode against itself, and the device granularities against the staged modes.
# Every case is a writer process and a reader process (~25 s each on 2 cores), so the
# list holds only what adds coverage. The cases outside EXTENDED (what CI runs) still
# cover every model, every mode written and read, and both process layouts.
CASES: list[Case] = [
    *((model, "whole", "layerwise", "1") for model in MODELS),
    *((model, "layerwise", "whole", "0") for model in MODELS),
    ("lfm2", "layerwise", "layerwise", "1"),
    ("lfm2", "whole", "whole", "0"),
    ("lfm2", "ranged", "group", "0"),
    ("lfm2", "group", "ranged", "1"),
]
EXTENDED: set[Case] = {
    ("llama", "whole", "layerwise", "1"),
    ("lfm2", "whole", "layerwise", "1"),
    ("gemma3", "layerwise", "whole", "0"),
    ("lfm2", "layerwise", "layerwise", "1"),
    ("lfm2", "whole", "whole", "0"),
}
CASE_ARGS = ("model", "writer", "reader", "multiproc")


def _params(cases: list[Case]) -> list[object]:
    return [
        pytest.param(
            *case,
            id="{}-{}-to-{}-mp{}".format(*case),
            marks=[pytest.mark.extended] if case in EXTENDED else [],
        )
        for case in cases
    ]


@dataclass
class Exchange:
    """What one writer stored and what the reader then saw."""

    reference: Reference
    writer_keys: dict[str, list[str]]  # new pool keys after each writer step
    reader: dict[str, PromptResult]
    unreadable_after_writer_exit: list[str]


class _Exchanges:
    """Each exchange runs once per session; a failed one fails every test that uses it."""

    def __init__(self, pool: Pool, references: dict[str, Reference], runs: Path) -> None:
        self._pool = pool
        self._references = references
        self._runs = runs
        self._done: dict[Case, Exchange | Exception] = {}

    def __getitem__(self, case: Case) -> Exchange:
        if case not in self._done:
            try:
                self._done[case] = self._run(*case)
            except Exception as error:
                self._done[case] = error
        outcome = self._done[case]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _spec(
        self, model: str, namespace: str, mode: str, steps: list[Step], **connector: object
    ) -> InstanceSpec:
        return InstanceSpec(
            model=str(self._references[model].model_path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector={"namespace": namespace, **MODES[mode], **connector},
            master_http=self._pool.http,
            steps=steps,
        )

    def _run(self, model: str, writer: str, reader: str, multiproc: str) -> Exchange:
        reference = self._references[model]
        name = f"{model}-{writer}-{reader}-mp{multiproc}"
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": multiproc,
            "MOONCAKE_CONFIG_PATH": str(self._pool.config_path),
        }
        # a namespace of its own: no other exchange's objects can answer this one's lookups
        writer_spec = self._spec(
            model, name, writer, [Step(prompts=[p], snapshot_keys=True) for _, p in WRITER_STEPS]
        )
        before = set(list_pool_keys(self._pool.http))
        written = run_instance(writer_spec, self._runs, f"{name}-writer", env, timeout_s=300)
        names = [step_name for step_name, _ in WRITER_STEPS]
        writer_keys = keys_added_by_step(names, written.steps, before)
        empty = [step for step, keys in writer_keys.items() if not keys]
        if empty:  # nothing to tamper with: the controls below would prove nothing
            raise AssertionError(f"writer steps {empty} stored no new object")

        # The writer has exited: everything it stored must still be readable.
        surgeon = self._pool.surgeon
        unreadable = []
        for key in (k for keys in writer_keys.values() for k in keys):
            try:
                surgeon.read(key)
            except (AssertionError, LookupError):
                unreadable.append(key)

        prompts = dict(READER_PROMPTS)
        surgeon.corrupt(writer_keys["corrupted"])
        surgeon.remove(writer_keys["middle_block"])
        if len(reference.kv_groups) > 1:
            other_group = [
                key
                for key in writer_keys["corrupted_other_group"]
                if reference.kv_groups[group_of(key)] != FULL_ATTENTION
            ]
            # the writer's keys span every group (a hybrid model run as one group would
            # store keys without one, all read as group 0, and the control prove nothing)
            groups = {group_of(key) for key in writer_keys["corrupted_other_group"]}
            if groups != set(range(len(reference.kv_groups))) or not other_group:
                raise AssertionError(f"{name}: the writer stored keys of groups {groups}")
            surgeon.corrupt(other_group)
        else:
            del prompts["corrupted_other_group"]

        # The reader's every lookup searches the boundary with a few small queries (the path
        # of long prompts), so the controls below hold for it too.
        reader_spec = self._spec(
            model, name, reader, [Step(prompts=list(prompts.values()))], _exact_lookup_keys=0
        )
        read = run_instance(reader_spec, self._runs, f"{name}-reader", env, timeout_s=300)
        return Exchange(
            reference=reference,
            writer_keys=writer_keys,
            reader=dict(zip(prompts, read.steps[0].prompts, strict=True)),
            unreadable_after_writer_exit=unreadable,
        )


@pytest.fixture(scope="session")
def exchanges(
    vllm_ready: None, pool: Pool, references: dict[str, Reference], runs_dir: Path
) -> _Exchanges:
    return _Exchanges(pool, references, runs_dir)


def _describe(exchange: Exchange, prompt: str) -> str:
    got = exchange.reader[prompt]
    cold = exchange.reference.outputs[prompt]
    return (
        f"{prompt}: hit {got.external_hit_tokens} (expected {EXPECTED_HITS[prompt]}), "
        f"tokens {got.token_ids} vs cold {cold.token_ids}, "
        f"max logprob gap {logprob_gap(got, cold):.3g}"
    )


@pytest.mark.parametrize(CASE_ARGS, _params(CASES))
def test_writer_objects_outlive_the_writer(
    exchanges: _Exchanges, model: str, writer: str, reader: str, multiproc: str
) -> None:
    exchange = exchanges[(model, writer, reader, multiproc)]
    assert all(exchange.writer_keys.values())
    assert not exchange.unreadable_after_writer_exit


@pytest.mark.parametrize(CASE_ARGS, _params(CASES))
@pytest.mark.parametrize("prompt", ["shared_prefix", "same_prompt"])
def test_reader_reuses_prefix_with_identical_output(
    exchanges: _Exchanges, model: str, writer: str, reader: str, multiproc: str, prompt: str
) -> None:
    exchange = exchanges[(model, writer, reader, multiproc)]
    got, cold = exchange.reader[prompt], exchange.reference.outputs[prompt]
    assert got.external_hit_tokens == EXPECTED_HITS[prompt], _describe(exchange, prompt)
    assert logprob_gap(got, cold) <= LOGPROB_TOLERANCE, _describe(exchange, prompt)


@pytest.mark.parametrize(CASE_ARGS, _params(CASES))
def test_missing_middle_block_shrinks_hit_not_output(
    exchanges: _Exchanges, model: str, writer: str, reader: str, multiproc: str
) -> None:
    exchange = exchanges[(model, writer, reader, multiproc)]
    assert exchange.writer_keys["middle_block"], "the middle block stored no object"
    got = exchange.reader["missing_middle_block"]
    cold = exchange.reference.outputs["missing_middle_block"]
    assert got.external_hit_tokens == EXPECTED_HITS["missing_middle_block"], _describe(
        exchange, "missing_middle_block"
    )
    assert logprob_gap(got, cold) <= LOGPROB_TOLERANCE, _describe(exchange, "missing_middle_block")


@pytest.mark.parametrize(CASE_ARGS, _params(CASES))
def test_corrupted_objects_change_output(
    exchanges: _Exchanges, model: str, writer: str, reader: str, multiproc: str
) -> None:
    """Negative control: the reader really computes from the pool's bytes."""
    exchange = exchanges[(model, writer, reader, multiproc)]
    got, cold = exchange.reader["corrupted"], exchange.reference.outputs["corrupted"]
    assert got.external_hit_tokens == EXPECTED_HITS["corrupted"], _describe(exchange, "corrupted")
    assert changed(got, cold), _describe(exchange, "corrupted")


@pytest.mark.parametrize(CASE_ARGS, _params([c for c in CASES if c[0] in HYBRID_MODELS]))
def test_other_group_is_transferred(
    exchanges: _Exchanges, model: str, writer: str, reader: str, multiproc: str
) -> None:
    """Negative control: the sliding-window / conv-state group's objects are used too."""
    exchange = exchanges[(model, writer, reader, multiproc)]
    prompt = "corrupted_other_group"
    got, cold = exchange.reader[prompt], exchange.reference.outputs[prompt]
    assert got.external_hit_tokens == EXPECTED_HITS[prompt], _describe(exchange, prompt)
    assert changed(got, cold), _describe(exchange, prompt)


def test_models_have_the_kv_groups_under_test(references: dict[str, Reference]) -> None:
    """The tiny models exercise the cache layouts they are meant to."""
    kinds = {name: sorted(set(references[name].kv_groups)) for name in MODELS}
    assert kinds == {
        "llama": [FULL_ATTENTION],
        "gemma3": [FULL_ATTENTION, "SlidingWindowSpec"],
        "lfm2": [FULL_ATTENTION, "MambaSpec"],
    }, tinymodels.BUILDERS
