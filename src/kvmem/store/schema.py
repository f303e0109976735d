"""The store's tables, defined once and rendered to both SQL dialects (SQLite for a local store, PostgreSQL for a
shared one).

A column's type is abstract (``INT``, ``BIG``, ``NUM``, ``REAL``, ``TEXT``, ``KEY``, ``BLOB``, ``ROWID``); each
dialect says what it is (``KEY``: text compared byte by byte, so a prefix is one index range in both). What the
two dialects render is statement for statement the schema each backend has always created, then the tables
added since (the scope index), each only added to (``tests/test_store.py`` checks the text), so stores written
before stay readable. Reserved words (``user``, ``window``, ``row``) are quoted for PostgreSQL; SQLite takes them
bare, as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 4  # meta.sqlite PRAGMA user_version; kvmem_manifest.schema_version
# 4: facts.provenance (what a fact's KV was computed behind) and facts.stale (its KV awaits re-encoding)

# (name, type, constraints): a column. A table: (name, columns, table constraints).
TABLES: tuple[tuple[str, tuple[tuple[str, str, str], ...], tuple[str, ...]], ...] = (
    ("meta", (("key", "TEXT", "PRIMARY KEY"), ("value", "NUM", "NOT NULL")), ()),
    (
        "users",
        (
            ("user", "TEXT", "PRIMARY KEY"),
            ("version", "BIG", "NOT NULL"),
            ("window", "INT", "NOT NULL"),
            ("source", "TEXT", ""),
            ("compacted", "BIG", "NOT NULL DEFAULT 0"),
            ("updated", "REAL", "NOT NULL"),
        ),
        (),
    ),
    (
        "segments",
        (
            ("user", "TEXT", "NOT NULL"),
            ("segment", "TEXT", "NOT NULL"),
            ("kv_sha256", "TEXT", "NOT NULL"),
            ("num_tokens", "INT", "NOT NULL"),
        ),
        ("PRIMARY KEY ({user}, segment)",),
    ),
    (
        "facts",
        (
            ("row", "ROWID", ""),
            ("user", "TEXT", "NOT NULL"),
            ("fact_id", "TEXT", "NOT NULL"),
            ("text", "TEXT", "NOT NULL"),
            ("speaker", "TEXT", ""),
            ("source_turn", "TEXT", ""),
            ("date", "TEXT", ""),
            ("metadata", "TEXT", "NOT NULL DEFAULT '{}'"),
            ("token_ids", "TEXT", "NOT NULL"),
            ("segment", "TEXT", "NOT NULL"),
            ("token_offset", "INT", "NOT NULL"),
            ("window", "INT", "NOT NULL"),
            ("embedding", "BLOB", "NOT NULL"),
            ("added", "BIG", "NOT NULL"),
            ("deleted", "BIG", ""),
            ("created_at", "REAL", "NOT NULL"),
            ("updated_at", "REAL", "NOT NULL"),
            # JSON {"turns": [idx], "facts": [fact_id], "source": [idx]}: the window turns and the neighbour or
            # history facts its KV was computed behind, and the turns it came from; NULL: unknown (written before
            # schema 4), read as "behind every earlier turn and fact"
            ("provenance", "TEXT", ""),
            ("stale", "REAL", ""),  # its KV was computed behind erased text: re-encode by this time (Unix s)
        ),
        (),
    ),
    (
        "history",
        (
            ("id", "ROWID", ""),
            ("user", "TEXT", "NOT NULL"),
            ("fact_id", "TEXT", "NOT NULL"),
            ("event", "TEXT", "NOT NULL"),
            ("old_memory", "TEXT", ""),
            ("new_memory", "TEXT", ""),
            ("time", "REAL", "NOT NULL"),
            ("version", "BIG", "NOT NULL"),
        ),
        (),
    ),
    (
        "turns",
        (
            ("user", "TEXT", "NOT NULL"),
            ("idx", "INT", "NOT NULL"),
            ("dia_id", "TEXT", ""),
            ("speaker", "TEXT", ""),
            ("content", "TEXT", "NOT NULL"),
            ("time", "REAL", ""),
        ),
        ("PRIMARY KEY ({user}, idx)",),
    ),
    # the scope index: each store user (scope key, ``scopes``) by its parts, so a read naming some of a scope's
    # ids finds that caller's scopes by index range, never by listing every user of every tenant. Added after
    # schema 3's first stores: a store without it is read by listing its users (``Rows.has_table``)
    (
        "scopes",
        (
            ("scope", "KEY", "PRIMARY KEY"),
            ("head", "KEY", "NOT NULL"),  # the key up to its first '/': "<tenant>:<user_id>", or "<tenant>:"
            ("agent", "KEY", ""),
            ("run", "KEY", ""),
        ),
        (),
    ),
)
# (name, unique, table, columns, partial-index condition), each created after its table
INDEXES: dict[str, tuple[tuple[str, bool, str, str, str], ...]] = {
    "facts": (
        ("live_fact", True, "facts", "{user}, fact_id", "deleted IS NULL"),
        ("facts_id", False, "facts", "fact_id", ""),
        ("facts_user", False, "facts", "{user}, deleted", ""),
        ("facts_segment", False, "facts", "{user}, segment", "deleted IS NULL"),
    ),
    "history": (("history_fact", False, "history", "fact_id", ""),),
    "scopes": (
        ("scopes_head", False, "scopes", "head", ""),
        ("scopes_agent", False, "scopes", "agent, head", ""),
        ("scopes_run", False, "scopes", "run, head", ""),
    ),
}
# schema version -> the columns added by the next version ((table, column, type)), for stores written before
MIGRATIONS: dict[int, tuple[tuple[str, str, str], ...]] = {
    3: (("facts", "provenance", "TEXT"), ("facts", "stale", "REAL")),
}
RESERVED = ("user", "window", "row")  # quoted in PostgreSQL, where they are reserved words


@dataclass(frozen=True)
class Dialect:
    """What differs between the two SQL dialects: types, quoting, ``IF NOT EXISTS``, and what each backend adds
    to the shared tables (``before`` them, ``after_meta``: right after the meta table)."""

    types: dict[str, str]
    quote: bool
    if_not_exists: bool
    before: str
    after_meta: str

    def name(self, column: str) -> str:
        return f'"{column}"' if self.quote and column in RESERVED else column


SQLITE = Dialect(
    types={
        "TEXT": "TEXT",
        "KEY": "TEXT",  # BINARY collation: bytewise already
        "INT": "INTEGER",
        "BIG": "INTEGER",
        "NUM": "INTEGER",  # SQLite's INTEGER affinity keeps a non-integral value (a time) as REAL
        "REAL": "REAL",
        "BLOB": "BLOB",
        "ROWID": "INTEGER PRIMARY KEY AUTOINCREMENT",
    },
    quote=False,
    if_not_exists=True,
    before="PRAGMA journal_mode=WAL;\nPRAGMA user_version={version};\n",
    after_meta="INSERT OR IGNORE INTO meta (key, value) VALUES ('version', 0);\n",  # the version counter
)
POSTGRES = Dialect(
    types={
        "TEXT": "TEXT",
        "KEY": 'TEXT COLLATE "C"',  # bytewise, whatever the database's locale: prefix ranges use the index
        "INT": "INTEGER",
        "BIG": "BIGINT",
        "NUM": "DOUBLE PRECISION",
        "REAL": "DOUBLE PRECISION",
        "BLOB": "BYTEA",
        "ROWID": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    },
    quote=True,
    if_not_exists=False,
    # the manifest and header live in the database; versions come from a sequence (``start``: see PostgresRows)
    before=(
        "CREATE TABLE kvmem_manifest (\n"
        "    id INTEGER PRIMARY KEY CHECK (id = 1), schema_version INTEGER NOT NULL, manifest TEXT, header BYTEA);\n"
        "CREATE SEQUENCE kvmem_version START WITH {start};\n"
    ),
    after_meta="",
)


def render(dialect: Dialect, **values) -> str:
    """The DDL that creates a new store's schema in ``dialect``. ``values`` fill the dialect's placeholders
    (SQLite: none needed, ``version`` is ``SCHEMA_VERSION``; PostgreSQL: ``start``, the version sequence's first
    value)."""
    exists = " IF NOT EXISTS" if dialect.if_not_exists else ""
    user = dialect.name("user")
    out = [dialect.before.format(version=SCHEMA_VERSION, **values)]
    for table, columns, constraints in TABLES:
        cols = [" ".join(filter(None, (dialect.name(c), dialect.types[t], extra))) for c, t, extra in columns]
        cols += [c.format(user=user) for c in constraints]
        out.append(f"CREATE TABLE{exists} {table} (\n    {', '.join(cols)});\n")
        if table == "meta":
            out.append(dialect.after_meta)
        for name, unique, on, what, where in INDEXES.get(table, ()):
            kind = "UNIQUE INDEX" if unique else "INDEX"
            cond = f" WHERE {where}" if where else ""
            out.append(f"CREATE {kind}{exists} {name} ON {on} ({what.format(user=user)}){cond};\n")
    return "".join(out)


def migration(dialect: Dialect, version: int) -> list[str]:
    """The statements that bring a schema of ``version`` to ``SCHEMA_VERSION`` (columns added, so a migration
    rewrites no row). Raises ValueError for a version with no migration."""
    out = []
    for v in range(version, SCHEMA_VERSION):
        if v not in MIGRATIONS:
            raise ValueError(f"schema version {version} cannot be migrated to {SCHEMA_VERSION}")
        out += [f"ALTER TABLE {t} ADD COLUMN {dialect.name(c)} {dialect.types[ty]}" for t, c, ty in MIGRATIONS[v]]
    return out


# The full-text index of live facts' text (hybrid retrieval's keyword part), kept by the database itself on every
# write: SQLite's FTS5 table filled by triggers on ``facts``, PostgreSQL's GIN index over the text's tsvector. It is
# rendered apart from ``render`` (the tables above are unchanged), created with a new store; a store created before
# it has none (``Rows.has_text_index``) and is searched by embeddings alone. SQLite's ``owner`` column holds the
# user's name in hex (one token), so a search intersects the user's posting list instead of filtering every match.
TEXT_INDEX = {
    "sqlite": (
        "CREATE VIRTUAL TABLE IF NOT EXISTS facts_text USING fts5(text, owner, tokenize='porter unicode61');\n"
        "CREATE TRIGGER IF NOT EXISTS facts_text_add AFTER INSERT ON facts WHEN new.deleted IS NULL BEGIN\n"
        "    INSERT INTO facts_text (rowid, text, owner) VALUES (new.row, new.text, hex(new.user)); END;\n"
        "CREATE TRIGGER IF NOT EXISTS facts_text_tombstone AFTER UPDATE OF deleted ON facts\n"
        "    WHEN old.deleted IS NULL AND new.deleted IS NOT NULL BEGIN\n"
        "    DELETE FROM facts_text WHERE rowid = old.row; END;\n"
        "CREATE TRIGGER IF NOT EXISTS facts_text_drop AFTER DELETE ON facts WHEN old.deleted IS NULL BEGIN\n"
        "    DELETE FROM facts_text WHERE rowid = old.row; END;\n"
        "INSERT INTO facts_text (rowid, text, owner) SELECT row, text, hex(user) FROM facts\n"
        "    WHERE deleted IS NULL AND row NOT IN (SELECT rowid FROM facts_text);\n"
    ),
    "postgres": (
        "CREATE INDEX IF NOT EXISTS facts_text ON facts USING GIN (to_tsvector('english', text))"
        " WHERE deleted IS NULL;\n"
    ),
}


def render_text_index(dialect: Dialect) -> str:
    """The DDL of the full-text index (``TEXT_INDEX``) in ``dialect``; idempotent, and it indexes the live facts
    already there, so it also adds the index to a store created before it."""
    return TEXT_INDEX["postgres" if dialect.quote else "sqlite"]
