"""Optional dependencies: the extras in pyproject.toml and kvmem.extras agree, and a feature whose extra is missing
fails with one line that names ``pip install 'kvmem[<extra>]'`` (no traceback). A module is made missing the way
Python itself marks one: ``sys.modules[name] = None`` (``import`` raises ModuleNotFoundError, ``find_spec``
finds nothing)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from kvmem.cli import app
from kvmem.extras import EXTRAS, MissingExtra, missing, require

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_extras_agree_with_pyproject():
    optional = PYPROJECT["optional-dependencies"]
    dists = packages_distributions()  # top-level module -> the installed distributions that provide it
    for extra, modules in EXTRAS.items():
        wanted = _names(optional[extra])
        provided = {canonicalize_name(d) for m in modules for d in dists.get(m, [])}
        assert provided == wanted, (extra, modules, optional[extra])
    assert optional["all"] == [f"kvmem[{','.join(EXTRAS)}]"]
    core = _names(PYPROJECT["dependencies"])
    assert not core & set().union(*(_names(optional[e]) for e in EXTRAS)), "an extra's package is also core"


def test_every_extra_is_installed_here():
    """The development set-up (scripts/setup.sh) installs every extra, so no test skips for want of one."""
    assert {extra: missing(extra) for extra in EXTRAS} == dict.fromkeys(EXTRAS, [])


def test_require_names_the_extra(monkeypatch):
    require("postgres", "a postgresql:// store")  # installed: nothing happens
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(MissingExtra) as err:
        require("postgres", "a postgresql:// store")
    assert (
        str(err.value) == "a postgresql:// store needs psycopg, which is not installed: pip install 'kvmem[postgres]'"
    )
    assert isinstance(err.value, ImportError) and err.value.name == "psycopg"
    monkeypatch.setitem(sys.modules, "obstore", None)
    monkeypatch.setitem(sys.modules, "diskcache", None)
    with pytest.raises(
        MissingExtra, match=r"^x needs obstore and diskcache, which are not installed: pip install 'kvmem\[s3\]'$"
    ):
        require("s3", "x")


def _one_error_line(result, extra: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert lines[0].endswith(f"pip install 'kvmem[{extra}]'"), lines[0]
    return lines[0]


def test_serve_replicas_without_ray(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    result = CliRunner().invoke(app, ["serve", "--store", str(tmp_path / "s"), "--replicas", "2"])
    assert "needs ray" in _one_error_line(result, "replicas")


def test_postgres_store_without_psycopg(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)
    result = CliRunner().invoke(app, ["memory", "list", "--store", "postgresql://kv@127.0.0.1:1/kvmem"])
    assert "a postgresql:// store needs psycopg" in _one_error_line(result, "postgres")


def test_segments_url_without_obstore(monkeypatch, tmp_path):
    from kvmem.store.segments import open_segments

    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(MissingExtra, match=r"KV segments by URL \(--segments\) needs obstore.*kvmem\[s3\]"):
        open_segments(tmp_path, (tmp_path / "objects").as_uri())
    assert not (tmp_path / "objects").exists()


def test_bench_without_matplotlib():
    """``kvmem.bench`` checks its extra on import, so a run never fails only at its plot (a new process: this one
    has imported it already)."""
    code = "import sys; sys.modules['matplotlib'] = None; from kvmem.cli import app; app(['bench', 'footprint'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == (
        "error: benchmarking (kvmem bench, kvmem eval) needs matplotlib, which is not installed: "
        "pip install 'kvmem[bench]'"
    )
