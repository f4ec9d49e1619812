"""vLLM-Ascend support: the layerwise window installed into its attention paths."""

from hybridkv.integration.ascend.windows import (
    ASCEND_WINDOW_TARGETS,
    AscendWindows,
    GraphModeNotSupportedError,
    WindowTarget,
    install_ascend_windows,
    require_eager,
)

__all__ = [
    "ASCEND_WINDOW_TARGETS",
    "AscendWindows",
    "GraphModeNotSupportedError",
    "WindowTarget",
    "install_ascend_windows",
    "require_eager",
]
