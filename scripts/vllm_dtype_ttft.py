"""vLLM's prefill TTFT and decode time per token in bf16 vs fp32 on this CPU (the rule behind
``hardware.choose_dtype`` for the vLLM engine), side by side in one run.

    .venv/bin/python scripts/vllm_dtype_ttft.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 512] [--runs 5]

Run it plainly, and under the AVX2 emulation (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``) to see
whether vLLM's bf16 is emulated there too. Prints one JSON object: median / p95 TTFT (ms) per dtype and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()

    import torch

    from kvmem.engines.vllm.engine import VLLMEngine, cold_salt
    from kvmem.hardware import cpu_facts, plan
    from kvmem.models import model_dir

    out = {
        "machine": plan().to_json(),
        "env": {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")},
        "tokens": args.tokens,
        "runs": args.runs,
        "by_dtype": {},
    }
    if args.one:  # one engine per process: vLLM engines do not always release everything in-process
        g = torch.Generator().manual_seed(0)
        eng = VLLMEngine(
            model_dir(args.model), dtype=args.one, kv_cache_memory_bytes=1 << 30, max_model_len=2048, in_process=True
        )
        ttft, decode = [], []
        eng.generate_ids(torch.randint(100, 20000, (64,), generator=g).tolist(), None, 2, salt=cold_salt())
        for _ in range(args.runs):
            ids = torch.randint(100, 20000, (args.tokens,), generator=g).tolist()
            gen = eng.generate_ids(ids, None, 16, ignore_eos=True, salt=cold_salt())
            ttft.append(gen.ttft_ms)
            decode.append(gen.decode_ms / max(1, len(gen.token_ids) - 1))
        print(
            "RESULT "
            + json.dumps(
                {
                    "ttft_ms_median": round(statistics.median(ttft), 1),
                    "ttft_ms_p95": round(sorted(ttft)[int(0.95 * (len(ttft) - 1) + 0.5)], 1),
                    "decode_ms_per_token_median": round(statistics.median(decode), 2),
                }
            )
        )
        return
    for dtype in args.dtypes.split(","):
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                dtype,
                "--model",
                args.model,
                "--tokens",
                str(args.tokens),
                "--runs",
                str(args.runs),
            ],
            capture_output=True,
            text=True,
        )
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        out["by_dtype"][dtype] = json.loads(line[7:]) if line else {"error": p.stderr[-500:]}
    d = out["by_dtype"]
    if all("ttft_ms_median" in d.get(k, {}) for k in ("bfloat16", "float32")):
        out["ttft_bf16_over_fp32"] = round(d["bfloat16"]["ttft_ms_median"] / d["float32"]["ttft_ms_median"], 3)
        out["decode_bf16_over_fp32"] = round(
            d["bfloat16"]["decode_ms_per_token_median"] / d["float32"]["decode_ms_per_token_median"], 3
        )
    out["cpu"] = cpu_facts().cpu
    print(json.dumps(out, indent=1))


if __name__ == "__main__":  # vLLM spawns workers: engines start under this guard
    main()
