"""The vLLM engine: stock vLLM with kvmem's KV connector, split along vLLM's own seam between its two roles.

* ``engine``: the front end the service uses (``VLLMEngine``, ``AsyncVLLMEngine``), in the API process;
* ``params``: the request's memory reference (``MemoryRef``: one encoder, one decoder) and its cache salt;
* ``connector``: ``KvmemConnector``, the thin class vLLM loads by path, which hands each hook to one side;
* ``scheduler``: the scheduler side, in vLLM's engine-core process: which requests take injected memory;
* ``worker``: the worker side, in each model-runner process: composes and writes the memory's KV
  (``reader``: the reading half of a load);
* ``config``, ``stores``, ``metadata``: what both sides share: the settings fixed at engine start, each process's
  store handles and trust rule, and the loads the scheduler sends the worker each step.

Importing this package imports none of them (a connector side must not pull in the front end, nor the other side).
"""
