"""Parallel dims, device meshes and the functions that apply FSDP2 to a model."""
