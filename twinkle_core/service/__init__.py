"""The training service: one base model served over the Tinker API to many LoRA tenants (flows.service)."""
