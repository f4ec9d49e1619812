"""`tools/api_check.py` (`nox -s api_check`): what it calls a break in a vLLM release.

Built on small source trees standing in for two releases, so each break is one edit.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_SOURCE = """\
from abc import ABC, abstractmethod

class KVConnectorBase_V1(ABC):
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    def wait_for_save(self): ...
"""
UTILS = "vllm/v1/utils.py"
UTILS_SOURCE = "def helper(a, b): ...\n"
REEXPORT = "vllm/v1/__init__.py"
REEXPORT_SOURCE = "from .utils import helper\n"
OURS = {"start_load_kv", "wait_for_save", "__init__"}
IMPORTS = [("vllm.v1.utils", "helper"), ("vllm.v1", "helper")]


@pytest.fixture(scope="module")
def api_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_check", TOOLS / "api_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["api_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def release(root: Path, **changed: str) -> Path:
    """A release's source tree: the baseline files, with `changed` ones replaced."""
    files = {BASE: BASE_SOURCE, UTILS: UTILS_SOURCE, REEXPORT: REEXPORT_SOURCE}
    files.update({key.replace("__", "/") + ".py": text for key, text in changed.items()})
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def findings(api_check: ModuleType, old: Path, new: Path) -> list[tuple[bool, str]]:
    a, b = api_check.Wheel(old), api_check.Wheel(new)
    found = [*api_check.check_imports(a, b, IMPORTS), *api_check.check_connector_base(a, b, OURS)]
    return [(f.breaks, f.text) for f in found]


def test_an_identical_release_holds(api_check: ModuleType, tmp_path: Path) -> None:
    old, new = release(tmp_path / "old"), release(tmp_path / "new")
    assert findings(api_check, old, new) == []


def test_a_changed_parameter_of_an_overridden_method_breaks(
    api_check: ModuleType, tmp_path: Path
) -> None:
    changed = BASE_SOURCE.replace("def wait_for_save(self)", "def wait_for_save(self, step)")
    new = release(tmp_path / "new", **{BASE[:-3].replace("/", "__"): changed})
    assert findings(api_check, release(tmp_path / "old"), new) == [
        (True, "KVConnectorBase_V1.wait_for_save, which we override: (self) -> (self, step)")
    ]


def test_a_new_abstract_method_breaks_and_a_new_optional_one_is_noted(
    api_check: ModuleType, tmp_path: Path
) -> None:
    added = BASE_SOURCE + (
        "    @abstractmethod\n    def must(self): ...\n"
        '    def may(self, x=1):\n        """Optional."""\n'
    )
    new = release(tmp_path / "new", **{BASE[:-3].replace("/", "__"): added})
    assert findings(api_check, release(tmp_path / "old"), new) == [
        (False, "new in KVConnectorBase_V1: may(self, x=): Optional."),
        (True, "KVConnectorBase_V1.must is abstract and we lack it"),
    ]


def test_a_removed_name_breaks_through_its_reexport_too(
    api_check: ModuleType, tmp_path: Path
) -> None:
    new = release(tmp_path / "new", vllm__v1__utils="def other(): ...\n")
    assert findings(api_check, release(tmp_path / "old"), new) == [
        (True, "gone: vllm.v1.utils.helper"),
        (True, "gone: vllm.v1.helper"),
    ]


def test_an_appended_default_keeps_calls_binding_but_a_new_required_one_breaks(
    api_check: ModuleType, tmp_path: Path
) -> None:
    old = release(tmp_path / "old")
    optional = release(tmp_path / "optional", vllm__v1__utils="def helper(a, b, c=0): ...\n")
    required = release(tmp_path / "required", vllm__v1__utils="def helper(a, b, c): ...\n")
    assert [breaks for breaks, _ in findings(api_check, old, optional)] == [False, False]
    assert [breaks for breaks, _ in findings(api_check, old, required)] == [True, True]


def test_an_ascend_method_reached_through_a_runtime_chosen_class_is_found(
    api_check: ModuleType, tmp_path: Path
) -> None:
    wheel = tmp_path / "vllm_ascend-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("asc/__init__.py", "")
        archive.writestr(
            "asc/device.py",
            "class Base:\n    def op(self): ...\n"
            'def pick(): ...\nOperator: type["Base"] = pick()\n',
        )
        archive.writestr("asc/impl.py", "from asc.device import Operator\nclass Impl: ...\n")
    ascend = api_check.Wheel(wheel)
    targets = [("asc.impl", "Operator", "op"), ("asc.impl", "Impl", "forward")]
    assert [f.text for f in api_check.check_ascend(ascend, targets)] == [
        "vLLM-Ascend lacks asc.impl.Impl.forward (layerwise window)"
    ]


def test_the_connector_interface_is_read_from_integration_src(api_check: ModuleType) -> None:
    assert ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1") in (
        api_check.imported_from_vllm()
    )
    assert {"start_load_kv", "wait_for_save", "save_kv_layer"} <= api_check.connector_methods()
    assert len(api_check.ascend_targets()) == 5
