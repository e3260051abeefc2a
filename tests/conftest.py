"""Shared test settings: wandb never goes online from a test."""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
