"""The connector's former module path, kept because vLLM configurations name it (``kv_connector_module_path=
"kvmem.engines.vllm_connector"``): it re-exports ``kvmem.engines.vllm.connector``'s ``KvmemConnector``."""

from .vllm.connector import KvmemConnector

__all__ = ["KvmemConnector"]
