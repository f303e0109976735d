"""kvmem: KV-injection memory for LLM serving."""
