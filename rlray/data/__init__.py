"""Tokenizers, SFT examples and the packing of rollouts into trainer micro-batches."""
