"""Meshes and how a model is spread over them: parallel dims, process groups, tensor / context /
expert / pipeline parallel, activation checkpointing, compile."""
