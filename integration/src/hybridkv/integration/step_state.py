"""Where the worker stands in vLLM's step cycle: one object, named transitions.

vLLM binds a step's metadata (`begin`), the step's loads are settled once (`settle`),
its saves issued (`end`); a step that computed over a failed load leaves the steps vLLM
scheduled before it learnt of that (`blind_for`) to save nothing. Kept in one place so
the order of vLLM's hooks is followed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepState:
    """The worker's step: begun or not, its loads settled or not, and what it knows of
    earlier steps (the cache generation, steps scheduled before a failed load)."""

    open: bool = False  # begun, not ended
    idle: bool = False  # the bound step computes nothing
    generation: int = 0  # the scheduler's cache generation (a reset moves it)
    loads_raised: bool = False  # starting the step's loads raised: none of them loaded
    loads_failed: bool | None = (
        False  # whether the step computed over a failed load; None: unsettled
    )
    blind_steps: int = 0  # coming steps vLLM scheduled before it learnt of a failed load

    def begin(self) -> None:
        """The step's transfers are planned: its loads are to settle, it is to end."""
        self.loads_raised = False
        self.loads_failed = None
        self.open = True

    def lose_loads(self) -> None:
        """Starting the step's loads raised: the forward runs over blocks not loaded."""
        self.loads_raised = True

    def end(self) -> None:
        self.open = False

    @property
    def unsettled(self) -> bool:
        return self.loads_failed is None

    def settle(self, failed: bool) -> None:
        self.loads_failed = failed

    def blind_for(self, steps: int) -> None:
        """The step's loads failed: the next `steps` steps were scheduled without knowing."""
        self.blind_steps = steps

    def take_blind_step(self) -> bool:
        """Whether the step being bound was scheduled before a failed load was known (one
        fewer such step to come)."""
        if not self.blind_steps:
            return False
        self.blind_steps -= 1
        return True
