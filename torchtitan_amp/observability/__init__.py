"""What a run measures and where it goes: throughput and MFU, the log line and metrics.jsonl,
TensorBoard and W&B, profiling, collective traffic, host syncs."""
