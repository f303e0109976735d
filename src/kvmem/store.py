"""The on-disk memory store: fact metadata (SQLite), per-user KV and embeddings (safetensors), a manifest.

Layout of a store directory::

    manifest.json            format, model fingerprint, header text + token ids, embedder
    header.safetensors       header pre-RoPE keys / raw values, [L, H, h, D]
    meta.sqlite              users(user, version, window, files...) and facts(user, row, fact_id, text, ...)
    users/<user>.<version>.kv.safetensors    keys / values [L, H, N, D], all of a user's fact tokens packed
    users/<user>.<version>.emb.safetensors   embeddings [F, E] float32, row order = facts.row

A user is replaced atomically: new files are written under a new version and fsynced (with their directory),
then one SQLite transaction points the user at them (with the KV file's SHA-256), then the old files go. A crash
or power loss at any point leaves the previous version readable; files no row points at are orphans that the
next writer or ``fsck`` removes. Writers serialize on a file lock (``.writer.lock``); SQLite runs in WAL mode
with a busy timeout. Readers take the user row and fact rows in one read transaction (one snapshot) and load
that version's files, retrying cleanly if a concurrent writer removed them in between; every KV file read is
checked against its recorded SHA-256.
Stored KV carries the model fingerprint; opening a store with another model is refused (``StoreMismatch``).
Opening never writes (no DDL): the schema is made by ``create`` and its version checked on open.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file
from safetensors.torch import save_file as _save_file

FORMAT_VERSION = 2  # manifest format; 2: checksummed, versioned schema (stores of format 1 must be re-ingested)
SCHEMA_VERSION = 2  # meta.sqlite PRAGMA user_version
BUSY_TIMEOUT_S = 30.0
_UMASK = os.umask(0)
os.umask(_UMASK)


def save_file(tensors: dict, path: Path) -> str:
    """Write, fsync and return the SHA-256 of a safetensors file. safetensors' writer creates files 0600; give them
    the same umask-derived mode as the manifest and SQLite."""
    _save_file(tensors, path)
    os.chmod(path, 0o666 & ~_UMASK)
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
    return digest


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StoreError(RuntimeError):
    """Missing or unreadable store, unknown user."""


class StoreMismatch(StoreError):
    """The store's KV was produced by a different model, tokenizer, dtype or RoPE config."""


class StoreDtypeMismatch(StoreMismatch):
    """Same model, but the store's KV was computed in another dtype than the one serving it."""


@dataclass(frozen=True)
class FactRecord:
    fact_id: str
    user: str
    text: str
    speaker: str
    source_turn: str
    date: str
    token_ids: tuple[int, ...]
    token_offset: int  # into the user's packed [.., N, ..] tensors
    window: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class UserKV:
    """A user's packed fact KV: keys/values [L, H, N, D]; fact ``i`` owns tokens offsets[i]:offsets[i]+lengths[i]."""

    user: str
    version: str
    facts: list[FactRecord]
    keys: torch.Tensor
    values: torch.Tensor
    embeddings: torch.Tensor  # [F, E] float32, L2-normalised

    def row_of(self) -> dict[str, int]:
        """fact_id -> row in ``facts`` (and in ``embeddings``)."""
        return {f.fact_id: i for i, f in enumerate(self.facts)}


_SCHEMA = f"""
PRAGMA journal_mode=WAL;
PRAGMA user_version={SCHEMA_VERSION};
CREATE TABLE IF NOT EXISTS users (
    user TEXT PRIMARY KEY, version TEXT NOT NULL, window INTEGER NOT NULL,
    num_facts INTEGER NOT NULL, num_tokens INTEGER NOT NULL, source TEXT, updated REAL NOT NULL,
    kv_sha256 TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS facts (
    user TEXT NOT NULL, row INTEGER NOT NULL, fact_id TEXT NOT NULL, text TEXT NOT NULL, speaker TEXT,
    source_turn TEXT, date TEXT, token_ids TEXT NOT NULL, token_offset INTEGER NOT NULL, window INTEGER NOT NULL,
    PRIMARY KEY (user, row), UNIQUE (user, fact_id));
"""


def _safe(user: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", user)


def fingerprint_diff(a: dict, b: dict) -> list[str]:
    return [f"{k}: store has {a.get(k)!r}, model has {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class Store:
    """A directory of users' memory. Use ``Store.create`` / ``Store.open``."""

    def __init__(self, root: Path, manifest: dict, schema: str | None = None):
        self.root = root
        self.manifest = manifest
        db = root / "meta.sqlite"
        if schema is None and not db.exists():
            raise StoreError(f"store {root} has no meta.sqlite (corrupt)")
        try:
            self._db = sqlite3.connect(db, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            if schema is not None:  # Store.create only: opening never writes
                self._db.executescript(schema)
            got = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{db} is corrupt: {exc}") from None
        if got != SCHEMA_VERSION:
            raise StoreError(f"{db}: schema version {got} is not {SCHEMA_VERSION}; re-ingest into a new store")
        self._user_cache: dict[str, UserKV] = {}
        self._header: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- lifecycle -----------------------------------------------------------------------------------

    @classmethod
    def create(cls, root: str | Path, fingerprint: dict, header_text: str, header_token_ids: list[int],
               header_keys: torch.Tensor, header_values: torch.Tensor, embedder: dict) -> "Store":
        """Create a new store (the directory must not hold one). Header K/V: [L, H, h, D] pre-RoPE / raw."""
        root = Path(root)
        if (root / "manifest.json").exists():
            raise StoreError(f"{root} already holds a store")
        if root.exists() and not root.is_dir():
            raise StoreError(f"--store {root} is a file, not a directory")
        if (root / "meta.sqlite").exists() or any((root / "users").glob("*.safetensors")):
            raise StoreError(f"store {root} has data but no manifest.json (corrupt); refusing to overwrite it")
        (root / "users").mkdir(parents=True, exist_ok=True)
        save_file({"keys": header_keys.contiguous(), "values": header_values.contiguous()}, root / "header.safetensors")
        store = cls(root, {}, schema=_SCHEMA)  # the schema exists before the manifest that makes it a store
        store.close()
        manifest = {
            "format": FORMAT_VERSION,
            "created": time.time(),
            "fingerprint": fingerprint,
            "header": {"text": header_text, "token_ids": list(header_token_ids)},
            "embedder": embedder,
        }
        tmp = root / "manifest.json.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(manifest, indent=2))
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(root / "manifest.json")
        fsync_dir(root)
        return cls(root, manifest)

    @classmethod
    def open(cls, root: str | Path, fingerprint: dict | None = None) -> "Store":
        """Open an existing store. If ``fingerprint`` is given it must equal the store's.

        Raises:
            StoreError: no store at ``root``.
            StoreMismatch: the store was produced by another model/tokenizer/dtype/RoPE config.
        """
        root = Path(root)
        path = root / "manifest.json"
        if not path.exists():
            raise StoreError(f"no kvmem store at {root} (run `kvmem ingest-locomo ... --store {root}` first)")
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path} is corrupt: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise StoreError(f"{root}: store format {got} is not {FORMAT_VERSION}; re-ingest it into a new store")
        if not isinstance(manifest.get("fingerprint"), dict) or not isinstance(manifest.get("header"), dict) \
                or not isinstance(manifest.get("embedder"), dict):
            raise StoreError(f"{path} is corrupt: fingerprint, header or embedder missing")
        if fingerprint is not None and manifest["fingerprint"] != fingerprint:
            theirs, ours = manifest["fingerprint"], fingerprint
            if {k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)} == {"dtype"}:
                raise StoreDtypeMismatch(
                    f"store {root} holds KV computed in {theirs['dtype']}, but this run computes in {ours['dtype']}; "
                    f"KV is never served in another dtype than it was computed in. Either serve it with "
                    f"--dtype {theirs['dtype']} (see `kvmem doctor` for what is fast here), or re-encode it into a "
                    f"new store with `kvmem ingest-locomo ... --store NEW_DIR --dtype {ours['dtype']}`")
            diff = fingerprint_diff(manifest["fingerprint"], fingerprint)
            raise StoreMismatch(
                f"store {root} was built with model {manifest['fingerprint'].get('model')!r} and does not match "
                f"the loaded model {fingerprint.get('model')!r}; refusing to inject its KV ({'; '.join(diff[:3])})"
            )
        return cls(root, manifest)

    def close(self) -> None:
        self._db.close()

    # --- reads ----------------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> dict:
        return self.manifest["fingerprint"]

    @property
    def header_token_ids(self) -> list[int]:
        return list(self.manifest["header"]["token_ids"])

    def header_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Header pre-RoPE keys and raw values, [L, H, h, D] each."""
        if self._header is None:
            t = load_file(self.root / "header.safetensors")
            self._header = (t["keys"], t["values"])
        return self._header

    def users(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT user FROM users ORDER BY user")]

    def user_info(self, user: str) -> dict:
        row = self._db.execute(
            "SELECT version, window, num_facts, num_tokens, source, kv_sha256 FROM users WHERE user=?",
            (user,)).fetchone()
        if row is None:
            known = ", ".join(self.users()) or "none"
            raise StoreError(f"unknown user {user!r} in store {self.root} (users: {known})")
        return dict(zip(("version", "window", "num_facts", "num_tokens", "source", "kv_sha256"), row))

    def _fact_rows(self, user: str) -> list[FactRecord]:
        rows = self._db.execute(
            "SELECT fact_id, user, text, speaker, source_turn, date, token_ids, token_offset, window "
            "FROM facts WHERE user=? ORDER BY row", (user,))
        return [FactRecord(r[0], r[1], r[2], r[3], r[4], r[5], tuple(json.loads(r[6])), r[7], r[8]) for r in rows]

    def facts(self, user: str) -> list[FactRecord]:
        return self._read(user)[1]

    def _read(self, user: str) -> tuple[dict, list[FactRecord]]:
        """The user row and its fact rows from one read transaction (one snapshot of the database)."""
        self._db.execute("BEGIN")
        try:
            return self.user_info(user), self._fact_rows(user)
        finally:
            self._db.execute("COMMIT")

    def _files(self, user: str, version: str) -> tuple[Path, Path]:
        stem = self.root / "users" / f"{_safe(user)}.{version}"
        return stem.with_name(stem.name + ".kv.safetensors"), stem.with_name(stem.name + ".emb.safetensors")

    def snapshot(self, user: str, version: str | None = None, retries: int = 5) -> UserKV:
        """One consistent version of ``user``'s memory: rows and tensors of the same version, KV checksummed.

        ``version``: that exact version or LookupError (it was replaced); None: the current one, retried
        cleanly when a concurrent writer replaces it between the row read and the file read. Cached in memory
        per (user, version). Raises StoreError for an unknown user or missing/corrupt files of a current version.
        """
        for attempt in range(retries + 1):
            cached = self._user_cache.get(user)
            info, facts = self._read(user)
            if version is not None and info["version"] != version:
                raise LookupError(f"memory version {version} of {user!r} is no longer current")
            if cached is not None and cached.version == info["version"]:
                return cached
            kv_path, emb_path = self._files(user, info["version"])
            try:
                data = kv_path.read_bytes()
                emb = load_file(emb_path)
            except FileNotFoundError:
                if attempt < retries and self.user_info(user)["version"] != info["version"]:
                    continue  # replaced under us: read the new version
                raise StoreError(f"store {self.root}: files of user {user!r} version {info['version']} are missing "
                                 f"(run `kvmem store fsck --store {self.root}`)") from None
            if hashlib.sha256(data).hexdigest() != info["kv_sha256"]:
                raise StoreError(f"store {self.root}: KV of user {user!r} version {info['version']} fails its "
                                 f"checksum (truncated or corrupt file)")
            try:
                kv = load_bytes(data)
            except Exception as exc:  # corrupt header despite a matching checksum: report, never a traceback
                raise StoreError(f"store {self.root}: cannot read user {user!r} ({exc})") from None
            ukv = UserKV(user, info["version"], facts, kv["keys"], kv["values"], emb["embeddings"])
            self._user_cache[user] = ukv
            return ukv
        raise StoreError(f"store {self.root}: user {user!r} kept changing while being read")

    def user_kv(self, user: str) -> UserKV:
        """A user's current facts with packed KV and embeddings (``snapshot(user)``)."""
        return self.snapshot(user)

    # --- writes ---------------------------------------------------------------------------------------

    @contextmanager
    def writer(self):
        """The store's single-writer lock (a file lock: concurrent writers, in any process, serialize)."""
        with open(self.root / ".writer.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _orphans(self) -> list[Path]:
        """Files under users/ that no row points at (left by a writer killed before its commit). Call under
        ``writer()``: only then can no uncommitted write be in flight."""
        live = {p.name for user, version in self._db.execute("SELECT user, version FROM users")
                for p in self._files(user, version)}
        return [p for p in (self.root / "users").iterdir() if p.name not in live]

    def fsck(self) -> dict:
        """Check every user (rows, files, KV checksum) and remove orphaned files. Returns a report:
        ``{"users": n, "ok": [...], "bad": {user: why}, "removed": [file names]}``."""
        with self.writer():
            removed = []
            for p in self._orphans():
                p.unlink(missing_ok=True)
                removed.append(p.name)
            ok, bad = [], {}
            for user in self.users():
                self._user_cache.pop(user, None)
                try:
                    ukv = self.snapshot(user)
                    if ukv.keys.shape[2] != sum(f.num_tokens for f in ukv.facts) or ukv.embeddings.shape[0] != len(
                            ukv.facts):
                        raise StoreError("tensor sizes do not match the fact rows")
                    ok.append(user)
                except (StoreError, LookupError) as exc:
                    bad[user] = str(exc)
        return {"users": len(ok) + len(bad), "ok": ok, "bad": bad, "removed": removed}

    def put_user(self, user: str, facts: list[FactRecord], keys: list[torch.Tensor], values: list[torch.Tensor],
                 embeddings: torch.Tensor, window: int, source: str = "") -> str:
        """Replace ``user``'s memory atomically. keys/values: one [L, H, n_i, D] per fact (n_i = its token count);
        embeddings: [F, E].

        Returns the new memory version. ``FactRecord.token_offset`` is recomputed here. Raises StoreError, with
        nothing written, for no facts, duplicate fact ids, or counts/shapes that do not match the facts.
        """
        if not facts:
            raise StoreError(f"user {user!r}: no facts to store")
        if len({f.fact_id for f in facts}) != len(facts):
            raise StoreError(f"user {user!r}: duplicate fact_id")
        if not (len(keys) == len(values) == len(facts) == embeddings.shape[0]):
            raise StoreError(f"user {user!r}: {len(facts)} facts but {len(keys)} keys, {len(values)} values and "
                             f"{embeddings.shape[0]} embeddings")
        for f, k, v in zip(facts, keys, values):
            if k.shape != v.shape or k.shape[2] != f.num_tokens:
                raise StoreError(f"fact {f.fact_id}: keys {tuple(k.shape)} / values {tuple(v.shape)} for "
                                 f"{f.num_tokens} token ids")
        offset, rows = 0, []
        for i, f in enumerate(facts):
            rows.append((user, i, f.fact_id, f.text, f.speaker, f.source_turn, f.date, json.dumps(list(f.token_ids)),
                         offset, window))
            offset += f.num_tokens
        with self.writer():
            for p in self._orphans():  # a killed writer's leftovers
                p.unlink(missing_ok=True)
            version = uuid.uuid4().hex[:12]
            kv_path, emb_path = self._files(user, version)
            digest = save_file({"keys": torch.cat(keys, dim=2).contiguous(),
                                "values": torch.cat(values, dim=2).contiguous()}, kv_path)
            save_file({"embeddings": embeddings.float().contiguous()}, emb_path)
            fsync_dir(kv_path.parent)  # the files are durable before the commit that points at them
            old = self._db.execute("SELECT version FROM users WHERE user=?", (user,)).fetchone()
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("DELETE FROM facts WHERE user=?", (user,))
                self._db.executemany(
                    "INSERT INTO facts (user, row, fact_id, text, speaker, source_turn, date, token_ids, token_offset,"
                    " window) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
                self._db.execute(
                    "INSERT OR REPLACE INTO users (user, version, window, num_facts, num_tokens, source, updated, "
                    "kv_sha256) VALUES (?,?,?,?,?,?,?,?)",
                    (user, version, window, len(facts), offset, source, time.time(), digest))
            if old:
                for p in self._files(user, old[0]):
                    p.unlink(missing_ok=True)
        self._user_cache.pop(user, None)
        return version
