"""Tiny random-weight models of the real architectures, built offline.

Contract: `model_path(cfg)` returns a directory that transformers and vLLM can both
load. For `cfg.name == "tiny"` it materialises a random-weight model of `cfg.arch` (a family of
rlray.config.families: its config class and tiny dimensions, or its vision-language twin in
rlray.models.vision) with the offline character tokenizer in a cache keyed by the config
(`$RLRAY_CACHE`, default `<tmp>/rlray-models`); the seed makes every node build
identical weights. Any other name is returned unchanged (an HF id or a local path).

The cache is rank-safe: one process per node builds an entry (the others wait on a
file lock), the build runs in a fresh Python process (transformers' `save_pretrained`
writes nothing on ranks other than 0 once torch.distributed is initialised), and an
entry is committed only after its files are checked and recorded in a manifest. An
entry whose files do not match its manifest (truncated, half-copied) is rebuilt.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlray.config import ModelConfig
from rlray.config.families import family

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MANIFEST = "rlray-manifest.json"
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    return Path(os.environ.get("RLRAY_CACHE", Path(tempfile.gettempdir()) / "rlray-models"))


def _common(cfg: ModelConfig, vocab: int, tok) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": 512,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def tiny_architecture(cfg: ModelConfig, vocab: int, tok) -> PretrainedConfig:
    """The transformers config of a tiny `cfg.arch` model (the default family when unset) over `tok`'s vocabulary."""
    import transformers

    from rlray.models import vision

    f = family(cfg.arch)
    if f.vision:  # its own tokenizer: the character one plus the family's vision tokens
        return vision.VISION_ARCHS[f.vision].config(cfg, vision.vision_tokenizer(f.vision))
    return getattr(transformers, f.config_class)(**{**_common(cfg, vocab, tok), **f.tiny(cfg)})  # a family may override


BUILD = 2  # bumped when a build writes other files for the same config (2: Qwen3-VL-MoE's expert layout)


def _key(cfg: ModelConfig) -> str:
    blob = json.dumps({**dataclasses.asdict(cfg), "build": BUILD}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def build(cfg: ModelConfig, out: Path) -> None:
    """Write the model and tokenizer to `out`; call only where torch.distributed is not initialised."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer
    from rlray.models import vision

    if family(cfg.arch).vision:  # a vision-language family: its processor is written too
        vision.build_tiny(cfg, out)
        return

    tok = char_tokenizer()
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(tiny_architecture(cfg, len(tok), tok), dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _check(out: Path) -> dict[str, int]:
    """The sizes of an entry's files; raises if the model or tokenizer is incomplete."""
    from safetensors import safe_open

    missing = [name for name in REQUIRED if not (out / name).is_file()]
    weights = sorted(out.glob("*.safetensors"))
    if missing or not weights:
        raise RuntimeError(f"tiny model build in {out} is incomplete: missing {missing or 'weights'}")
    if "model_type" not in json.loads((out / "config.json").read_text()):
        raise RuntimeError(f"{out / 'config.json'} has no model_type")
    for path in weights:
        with safe_open(str(path), "pt") as f:
            if not list(f.keys()):
                raise RuntimeError(f"{path} holds no tensors")
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


def is_complete(entry: Path) -> bool:
    """True when `entry` has a manifest and every file it lists has the recorded size."""
    try:
        sizes = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all((entry / name).is_file() and (entry / name).stat().st_size == size for name, size in sizes.items())


def _build_in_subprocess(cfg: ModelConfig, out: Path) -> None:
    blob = json.dumps(dataclasses.asdict(cfg))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "rlray.models.tiny", blob, str(out)], check=False,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny {cfg.arch} model failed:\n{done.stderr[-4000:]}")


def model_path(cfg: ModelConfig, cache: Path | None = None) -> str:
    if cfg.name != "tiny":
        return cfg.name
    root = cache or cache_dir()
    final = root / f"{cfg.arch}-{_key(cfg)}"
    if is_complete(final):
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per node; the others wait, then find it done
        if not is_complete(final):
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
            try:
                _build_in_subprocess(cfg, tmp)
                (tmp / MANIFEST).write_text(json.dumps(_check(tmp)))
                shutil.rmtree(final, ignore_errors=True)  # an incomplete entry is replaced, never loaded
                tmp.rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


if __name__ == "__main__":
    build(ModelConfig(**json.loads(sys.argv[1])), Path(sys.argv[2]))
