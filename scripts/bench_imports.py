"""Peak memory of one ``Memory.import_memories`` call (what ``POST /v1/memories/import`` and ``kvmem memory
import`` run), in a fresh process: the model and embedder are loaded and warmed first, the peak RSS is reset
(``/proc/self/clear_refs``), then N small records of one scope are imported.

    python scripts/bench_imports.py --records 1000 --store /tmp/imp-1000 [--model smollm2-135m-instruct]

Prints one JSON line: records, seconds, rss_before (bytes), peak_rss (bytes), growth (peak - before, bytes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    from kvmem import Memory

    m = Memory(args.store, model=args.model)
    m.add("Warm-up fact.", user_id="warmup", infer=False)  # model, embedder and allocator warm
    export = {
        "results": [
            {"memory": f"Bulk fact number {i} is about topic {i % 97}.", "user_id": "bulk"} for i in range(args.records)
        ]
    }
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = status("VmRSS")
    t0 = time.perf_counter()
    out = m.import_memories(export)
    seconds = time.perf_counter() - t0
    peak = status("VmHWM")
    assert out["count"] == args.records, out
    print(json.dumps({"records": args.records, "seconds": round(seconds, 1), "rss_before": before,
                      "peak_rss": peak, "growth": peak - before}))  # fmt: skip


if __name__ == "__main__":
    main()
