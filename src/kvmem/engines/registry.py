"""What each engine can do, declared once, and the one refusal of a method an engine cannot serve.

This module imports no engine (nor torch, transformers or vLLM): the CLI and the server check a request's
method against it before any engine starts, and the engine classes take their capability attributes from it
(``base.Engine`` / ``base.AsyncEngine`` fill them in from ``name``). Code that holds an engine asks its
``capabilities``, never which engine it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..policy import Method

__all__ = ["ENGINES", "Capabilities", "capabilities", "latent_refusal", "refusal"]


@dataclass(frozen=True)
class Capabilities:
    """One engine's abilities, where engines differ (every engine serves kv, prompt and kv-tail<r>).

    ``label``: how messages name it; ``selective_recompute``: recomputes chosen tokens inside the injected memory
    (``kv-sel<p>``); ``batches``: concurrent requests run in one batch (continuous batching) rather than one at a
    time; ``latent_attention``: injects the latent KV of multi-head latent attention models (DeepSeek V2 / V3);
    ``tools_kv``: injects a chat's tools block (``base.ToolsBlock``) as KV encoded once, instead of prefilling it;
    ``why_not``: per ability this engine lacks, the reason, as users read it."""

    label: str
    selective_recompute: bool = False
    batches: bool = False
    latent_attention: bool = True
    tools_kv: bool = False
    why_not: dict[str, str] = field(default_factory=dict)


ENGINES: dict[str, Capabilities] = {
    "hf": Capabilities("the transformers engine", selective_recompute=True, tools_kv=True),
    "vllm": Capabilities(
        "vLLM",
        batches=True,
        why_not={
            "selective_recompute": "its KV connector can report an injected prefix, not tokens to recompute inside it",
            "tools_kv": "its connector's worker injects only KV it reads from the store by the request's reference, "
            "and a tools block is not stored there",
        },
    ),
}

NONE = Capabilities("an unregistered engine")  # an engine not in ENGINES (tests' stand-ins): no selective recompute


def capabilities(engine: str) -> Capabilities:
    """The abilities of engine ``engine`` (a name in ``ENGINES``; anything else gets ``NONE``: no selective
    recompute, no batching)."""
    return ENGINES.get(engine, NONE)


def refusal(method: Method, engine: str, *, started: bool = True) -> str | None:
    """Why ``engine`` cannot serve ``method``, as the ValueError message users read, or None when it can.

    ``started``: the engine is running (a request's check, naming the engine and the reason); False: the check
    of a command's options before any engine starts, which names the option that picks an engine that can."""
    if not method.recompute or capabilities(engine).selective_recompute:
        return None
    able = [name for name, caps in ENGINES.items() if caps.selective_recompute]
    labels = " or ".join(ENGINES[name].label for name in able)
    if not started:
        return f"kv-sel (selective recompute) runs on {labels} only: add " + " or ".join(
            f"--engine {name}" for name in able
        )
    reason = capabilities(engine).why_not.get("selective_recompute", "it cannot recompute inside injected memory")
    return f"kv-sel (query-aware selective recompute) runs on {labels} only, not on {engine}: {reason}"


def latent_refusal(engine: str) -> str | None:
    """Why ``engine`` cannot inject a multi-head latent attention model's KV (DeepSeek V2 / V3), as one line
    naming the engines that can, or None when it can."""
    caps = capabilities(engine)
    if caps.latent_attention:
        return None
    able = " or ".join(f"--engine {name}" for name, c in ENGINES.items() if c.latent_attention)
    reason = caps.why_not.get("latent_attention", "it cannot inject latent attention KV")
    return f"latent-attention models (DeepSeek V2/V3) cannot take injected KV on {caps.label}: {reason}; use {able}"
