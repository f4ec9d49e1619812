"""hybridkv's log records go where vLLM's go.

vLLM sets up only its own "vllm" logger (propagation off), so another library's records
reach nothing but Python's last-resort handler, which prints warnings only: a user would
never see what hybridkv reports at INFO (its pool, its layouts). Unless the application
set up logging itself (the root logger has handlers), hybridkv's loggers use vLLM's
handlers and level, so they look like vLLM's own lines.
"""

from __future__ import annotations

import logging


def follow_vllm_logging() -> None:
    """Attach vLLM's handlers to the "hybridkv" logger, once, if nothing else would."""
    ours, theirs = logging.getLogger("hybridkv"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
