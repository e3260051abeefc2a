"""Advantages and policy-gradient losses as pure torch/numpy functions, chosen by name."""
