"""Faithful stand-ins for packages that cannot run here (vllm-ascend, torch_npu).

They mirror the real module paths, class and method names and call order of the code they
replace, and are put on `sys.path` only when the real package is absent.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

FAKES_DIR = Path(__file__).parent


def real_package_present(name: str) -> bool:
    """True when the real package is importable (then its fake must not shadow it)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and FAKES_DIR not in Path(spec.origin or "").parents
