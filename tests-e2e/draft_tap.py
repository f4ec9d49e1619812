"""A window on vLLM's EAGLE draft head: every proposal it makes, written to a file.

vLLM does not report draft tokens, and a random draft head has none accepted, so the
output alone cannot tell whether the draft layer's KV a reader loaded is the writer's.
Its proposals can: they are a function of that KV. An instance runs `record` as its
`InstanceSpec.prepare` (in-process engine), with `DRAFTS_FILE` in its environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

DRAFTS_FILE = "HYBRIDKV_TEST_DRAFTS_FILE"


class Proposal(msgspec.Struct, frozen=True):
    """One `propose` call: the last position the target computed, and the draft tokens of
    each request in the batch (one request here)."""

    last_position: int
    drafts: list[list[int]]


def record() -> None:
    """Wrap the proposers' `propose` so that each call appends a `Proposal` line."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    path = Path(os.environ[DRAFTS_FILE])
    propose = SpecDecodeBaseProposer.propose

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = propose(self, *args, **kwargs)
        positions = kwargs["target_positions"]  # vLLM's runner passes it by name
        proposal = Proposal(int(positions.max()), drafts.tolist())
        with path.open("a") as file:
            file.write(msgspec.json.encode(proposal).decode() + "\n")
        return drafts

    SpecDecodeBaseProposer.propose = recorded  # type: ignore[method-assign]


def read_proposals(path: Path) -> list[Proposal]:
    """Every proposal `record` wrote to `path`, in order."""
    return [msgspec.json.decode(line, type=Proposal) for line in path.read_text().splitlines()]


def proposals_after(proposals: list[Proposal], prompt_length: int, span: int) -> list[Proposal]:
    """The proposals made once a prompt of `prompt_length` tokens was computed: its last
    prefill chunk's and its decode steps', whose positions run `span` past it at most (a
    step verifies its token and the drafts), among those of several prompts whose lengths
    are more than `span` apart. Earlier chunks' calls differ with the hit: left out."""
    last = prompt_length - 1
    return [p for p in proposals if last <= p.last_position <= last + span]
