"""The training service: one base model served over the Tinker API to many LoRA tenants (`python -m flows.service`).

A layer above twinkle_core, beside the flows: `app` (the HTTP routes, ownership, futures) → `runner` (the
engine thread, batching) → `worker` (the worker tree, started by twinkle_core's launcher) → `engine` (the
model side: Tinker's semantics, over `transformers_engine` or `megatron_engine`) with `wire` (the protobuf
codec) and `losses` (Tinker's losses).
"""
