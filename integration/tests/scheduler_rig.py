"""The scheduler side against synthetic vLLM configs and a dict-backed pool: the pool, the
sides the scheduler tests build, and the writers and readers they run through it."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from conftest import attention, groups, mamba, request, scheduler_output

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.scheduler import SchedulerSide

TOKENS = list(range(100, 100 + 200))  # 6 full blocks of 32, plus 8 tokens


class Pool:
    """Readability from a set of keys; counts the batched queries it answers."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.queries = 0
        self.down = False

    def query(self, keys: Sequence[str]) -> list[bool] | None:
        self.queries += 1
        return None if self.down else [key in self.keys for key in keys]


def make_side(
    specs: Any, kinds: Any, shape: ModelShape, **config: Any
) -> tuple[SchedulerSide, Pool]:
    plan = plan_groups(groups(specs, *kinds), list(range(len(kinds))), shape)
    pool = Pool()
    return SchedulerSide(KeySpace(plan, "tiny"), ConnectorConfig(**config), pool.query), pool


def put_blocks(
    side: SchedulerSide,
    pool: Pool,
    tokens: list[int],
    heads: Sequence[int],
    upto: int,
    writer: Any = None,
    keys: KeySpace | None = None,
    generation: int = 0,
) -> None:
    """Put every group's blocks of the first `upto` tokens for `heads` (as `writer`, a
    request, computed them: its LoRA, salt...), under `keys` (default: the side's), as
    saved after `generation` cache resets."""
    keys = side.keys if keys is None else keys
    hashes = RequestHashes(side.plan, "", writer, generation)
    hashes.cover(tokens, upto)
    for group, plan in enumerate(side.plan.groups):
        blocks = hashes.for_group(plan.block_size)[: upto // plan.block_size]
        pool.keys.update(keys.keys(group, blocks, heads))


def block_keys(side: SchedulerSide, tokens: list[int], group: int, blocks: slice) -> list[str]:
    hashes = RequestHashes(side.plan, "", None)
    hashes.cover(tokens, len(tokens))
    size = side.plan.groups[group].block_size
    return side.keys.keys(group, hashes.for_group(size)[blocks], [0])


def image_input(identifier: str, offset: int, length: int) -> SimpleNamespace:
    """A multimodal input as vLLM's `MultiModalFeatureSpec` gives it."""
    return SimpleNamespace(
        identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def admit(
    side: SchedulerSide,
    req: Any,
    table: tuple[list[int], ...],
    local: int = 0,
    scheduled: int | None = None,
) -> Any:
    """The metadata of the step that admits a request the pool misses, with `local` tokens
    of vLLM's own hit, scheduling `scheduled` tokens (default: the rest of its prompt)."""
    assert side.num_new_matched_tokens(req, local) == (0, False)
    side.after_alloc(req, table, 0)
    count = len(req.all_token_ids) - local if scheduled is None else scheduled
    rid = req.request_id
    return side.build_meta(scheduler_output(new=[(rid, table, local, count)], tables={rid: table}))


def compute_after_reset(side: SchedulerSide, request_id: str, tokens: list[int]) -> None:
    """A request admitted without a hit and computed whole (its prefixes are then known
    fresh)."""
    admit(side, request(request_id, tokens), ([40 + b for b in range(len(tokens) // 32 + 1)],))


def window_full_state(vllm_specs: Any) -> tuple[SchedulerSide, Pool]:
    kinds = [
        (["w"], attention(vllm_specs, window=64)),
        (["f"], attention(vllm_specs)),
        (["m"], mamba(vllm_specs)),
    ]
    return make_side(vllm_specs, kinds, ModelShape(1, 2))


ONE_RANK = ModelShape(tp_size=1, total_kv_heads=2)


def tail_side(
    vllm_specs: Any,
    tail_unit: int = 8,
    shape: ModelShape = ONE_RANK,
    use_eagle: bool = False,
    local_hit_unit: int = 0,
    block_sizes: tuple[int, int] = (32, 32),
    **config: Any,
) -> tuple[SchedulerSide, Pool]:
    """Full attention beside a Mamba state, 32-token blocks (or `block_sizes`), vLLM
    hitting every `tail_unit` tokens (0: at block ends only) and hashing every
    `local_hit_unit`."""
    heads = shape.total_kv_heads // shape.tp_size or 1
    full, state = block_sizes
    kinds = [
        (["a"], attention(vllm_specs, block_size=full, heads=heads)),
        (["m"], mamba(vllm_specs, block_size=state)),
    ]
    plan = plan_groups(groups(vllm_specs, *kinds), [0, 1], shape)
    pool = Pool()
    side = SchedulerSide(
        KeySpace(plan, "tiny"),
        ConnectorConfig(**config),
        pool.query,
        tail_unit=tail_unit,
        use_eagle=use_eagle,
        local_hit_unit=local_hit_unit,
    )
    return side, pool


def write_prompt(
    side: SchedulerSide, pool: Pool, tokens: list[int], chunks: list[int], blocks: int = 8
) -> list:
    """Run a writer through prefill chunks ending at `chunks`; put what it saves."""
    req = request("w", tokens)
    side.after_alloc(req, ([], []), 0)
    tables = ([100 + b for b in range(blocks)], [200 + b for b in range(blocks)])
    saves = []
    done = 0
    for end in chunks:
        if done == 0:
            output = scheduler_output(new=[("w", tables, 0, end)], tables={"w": tables})
        else:
            output = scheduler_output(cached=[("w", done, end - done)], tables={"w": tables})
        for transfers in side.build_meta(output).requests:
            saves.extend(transfers.saves)
        done = end
    for ref in saves:  # every storing head's object, as each TP rank saves its own
        storing = range(side.plan.groups[ref.group].heads.storing)
        pool.keys.update(side.keys.keys(ref.group, [ref.block_hash], storing))
    return saves
