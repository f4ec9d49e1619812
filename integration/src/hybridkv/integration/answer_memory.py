"""Lookup answers remembered across scheduler steps, so a waiting request does not cost a
pool query each step.

vLLM asks `get_num_new_matched_tokens` again every step while a request waits (for room in
its KV cache, or behind others): the same request, the same tokens, the same answer unless
the pool changed. An answer is kept for `lookup_memory_s` and given again only to the
same request object asking about the same tokens from the same point. A stale "readable"
costs at worst a failed load, which vLLM recomputes; a stale miss, a hit found a moment
later. Any failed load or quarantine forgets every answer (another request's failure may
name objects this one's answer counted on), as does a cache reset.

Sans-I/O: the clock is passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Answer = TypeVar("Answer")


@dataclass(frozen=True, slots=True)
class _Remembered(Generic[Answer]):
    request: Any  # the object vLLM asked about (a new one under a reused id is another)
    num_computed: int
    num_tokens: int
    at: float
    answer: Answer


class AnswerMemory(Generic[Answer]):
    """The last answer per request id, given again while young and asked alike."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        """`seconds`: how long an answer is given again (0: never)."""
        self._seconds = seconds
        self._clock = clock
        self._by_id: dict[str, _Remembered[Answer]] = {}
        self.given_again = 0  # asks answered from memory, for the stats

    def answer(
        self, request: Any, num_computed: int, ask: Callable[[], Answer | None]
    ) -> Answer | None:
        """The remembered answer to this ask, or `ask()`'s (remembered unless None: the
        pool did not answer)."""
        now = self._clock()
        kept = self._by_id.get(request.request_id)
        if (
            kept is not None
            and kept.request is request
            and kept.num_computed == num_computed
            and kept.num_tokens == request.num_tokens
            and now - kept.at < self._seconds
        ):
            self.given_again += 1
            return kept.answer
        answer = ask()
        if answer is None or not self._seconds:
            self._by_id.pop(request.request_id, None)
        else:
            self._by_id[request.request_id] = _Remembered(
                request, num_computed, request.num_tokens, now, answer
            )
        return answer

    def forget(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def clear(self) -> None:
        self._by_id.clear()
