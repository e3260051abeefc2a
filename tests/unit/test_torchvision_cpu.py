"""torchvision's Python part imports beside this machine's CPU torch through rlray's hook, and not without it."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlray.models import torchvision_cpu

pytest.importorskip("torchvision")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_set_up_installed_the_hook_and_the_processors_import() -> None:
    done = run("import sys; assert 'rlray' not in sys.modules, 'the start-up hook imported the rlray package'\n"
               "import torch, torchvision, vllm\n"
               "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor\n"
               "from transformers.models.qwen3_vl import Qwen3VLVideoProcessor\n"
               "from torchvision.transforms.v2 import functional as F\n"
               "import json\n"
               "print(json.dumps([torch.version.cuda, torchvision.extension._has_ops(),\n"
               "                  hasattr(torch.ops.torchvision, 'nms'), list(F.resize(torch.rand(3, 64, 48), [32, 24]).shape)]))")
    assert done.returncode == 0, done.stderr[-3000:]
    cuda, has_ops, nms, shape = json.loads(done.stdout.splitlines()[-1])
    assert nms, done.stdout  # defined by the hook, or by torchvision's own C++ library where it loads
    if cuda is None:
        assert not has_ops, "a CPU torchvision build loads its ops: the hook is not needed on this machine"
    assert shape == [3, 32, 24]


def test_without_the_hook_torchvision_does_not_import_here() -> None:
    """Why the hook exists: torchvision registers a fake kernel for an operator its failed C++
    load never defined. Should a torchvision release guard that, this fails and the hook can go."""
    done = run("import sys\n"
               "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_Hook']\n"
               "import torch\n"
               "if torch.version.cuda is not None:\n"
               "    print('cuda torch'); raise SystemExit(0)\n"
               "import torchvision")
    if "cuda torch" in done.stdout:
        pytest.skip("a CUDA torch: torchvision's own C++ ops load")
    assert done.returncode != 0 and "torchvision::nms does not exist" in done.stderr, done.stderr[-2000:]


def test_write_pth_installs_the_hook_at_interpreter_start(tmp_path: Path) -> None:
    path = torchvision_cpu.write_pth(tmp_path)
    assert path.name == torchvision_cpu.PTH
    assert str(Path(torchvision_cpu.__file__).resolve()) in path.read_text()
    purelib = sysconfig.get_paths()["purelib"]
    for add, hooks in (("", "0"), (f"site.addsitedir({str(tmp_path)!r})", "1")):
        # -S: no site-packages .pth runs at start-up (this environment's own would install the hook)
        code = (f"import sys; sys.path[:0] = [{purelib!r}]\n"
                f"import site\n{add}\nprint([type(f).__name__ for f in sys.meta_path].count('_Hook'),\n"
                "      [m for m in sys.modules if m.split('.')[0] == 'rlray'])")
        done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.split()[0] == hooks, (add, done.stdout, done.stderr[-2000:])
        assert done.stdout.split()[-1] == "[]", done.stdout  # the rlray package itself is not imported
