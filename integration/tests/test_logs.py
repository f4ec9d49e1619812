"""hybridkv's INFO lines reach vLLM's log, unless the application set up logging itself."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from hybridkv.integration.logs import follow_vllm_logging


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def vllm_configured_alone() -> Iterator[Collect]:
    """A process where vLLM configured its logger and nobody configured any other (pytest's
    own handlers sit on the root during a test: they are put back afterwards)."""
    root, ours = logging.getLogger(), logging.getLogger("hybridkv")
    theirs = logging.getLogger("vllm")
    saved = [(logger, logger.handlers[:], logger.level) for logger in (root, ours, theirs)]
    root.handlers = []
    ours.handlers = []
    ours.setLevel(logging.NOTSET)
    handler = Collect()
    theirs.handlers = [handler]
    theirs.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        for logger, handlers, level in saved:
            logger.handlers = handlers
            logger.setLevel(level)


def test_hybridkv_info_lines_use_vllms_handler_once() -> None:
    with vllm_configured_alone() as vllm_handler:
        logging.getLogger("hybridkv.integration.connector").info("before")
        follow_vllm_logging()
        follow_vllm_logging()  # every connector calls it; the handler is attached once
        logging.getLogger("hybridkv.integration.connector").info("groups laid out")
        logging.getLogger("hybridkv.transport.engine").debug("below vLLM's level")
    assert vllm_handler.messages == ["groups laid out"]


def test_an_application_with_its_own_logging_keeps_it() -> None:
    with vllm_configured_alone() as vllm_handler:
        own = Collect()
        logging.getLogger().handlers = [own]
        follow_vllm_logging()
        assert not logging.getLogger("hybridkv").handlers
        logging.getLogger("hybridkv.integration.connector").warning("seen by the app alone")
    assert own.messages == ["seen by the app alone"]
    assert vllm_handler.messages == []
