"""Tiny random-weight models of the real architectures, built offline.

Contract: `model_path(cfg)` returns a directory that transformers and vLLM can both
load. For `cfg.name == "tiny"` it materialises (once per node, atomically, in a
cache keyed by the config) a random-weight model of `cfg.arch` with the offline
character tokenizer; the seed makes every node build identical weights. Any other
name is returned unchanged (an HF id or a local path).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from rlray.config import ModelConfig
from rlray.data.tokenizer import char_tokenizer

CACHE = Path(os.environ.get("RLRAY_CACHE", Path(tempfile.gettempdir()) / "rlray-models"))
ARCHS = ("qwen3", "qwen3_moe", "glm4_moe", "llama")


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
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def hf_config(cfg: ModelConfig, vocab: int, tok) -> PretrainedConfig:
    from transformers import Glm4MoeConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    base = _common(cfg, vocab, tok)
    moe = {"num_experts_per_tok": cfg.experts_per_token, "moe_intermediate_size": cfg.moe_intermediate_size}
    if cfg.arch == "qwen3":
        return Qwen3Config(**base)
    if cfg.arch == "llama":
        return LlamaConfig(**base)
    if cfg.arch == "qwen3_moe":
        return Qwen3MoeConfig(**base, **moe, num_experts=cfg.num_experts, decoder_sparse_step=1)
    if cfg.arch == "glm4_moe":
        return Glm4MoeConfig(**base, **moe, n_routed_experts=cfg.num_experts, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1)
    raise ValueError(f"model.arch='{cfg.arch}' is not a tiny architecture; choose one of {ARCHS}")


def _key(cfg: ModelConfig) -> str:
    blob = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def build(cfg: ModelConfig, out: Path) -> None:
    tok = char_tokenizer()
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, len(tok), tok), dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def model_path(cfg: ModelConfig) -> str:
    if cfg.name != "tiny":
        return cfg.name
    final = CACHE / f"{cfg.arch}-{_key(cfg)}"
    if not final.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".build-"))
        build(cfg, tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
