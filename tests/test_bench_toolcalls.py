"""``kvmem bench toolcalls``: the packaged case set is well formed, the per-case outcomes and the paired
comparison are computed as documented, and bad options or an unreachable server are one line and exit code 2.
(A run against a real server: tests/test_server_tools.py, the transformers engine.)"""

from __future__ import annotations

import jsonschema
import pytest

from conftest import kvmem_cli
from kvmem.bench.toolcalls import load_cases, paired, rates, score


def test_the_case_set_offers_three_tools_one_right_and_some_where_none_fits():
    tools, cases = load_cases()
    assert len(cases) >= 50 and len({c["id"] for c in cases}) == len(cases)
    none = [c for c in cases if c["expect"] is None]
    assert 10 <= len(none) < len(cases) - 40
    for c in cases:
        assert len(set(c["tools"])) == 3 and set(c["tools"]) <= set(tools), c["id"]
        if c["expect"] is not None:
            assert c["expect"]["name"] in c["tools"], c["id"]
            jsonschema.validate(c["expect"]["arguments"], tools[c["expect"]["name"]]["function"]["parameters"])
    # the right tool is not always in the same place
    assert {c["tools"].index(c["expect"]["name"]) for c in cases if c["expect"]} == {0, 1, 2}


def test_score_and_paired_comparison():
    tools, cases = load_cases()
    case = next(c for c in cases if c["expect"] and c["expect"]["name"] == "get_weather")
    none = next(c for c in cases if c["expect"] is None)
    exp = case["expect"]
    right = [dict(exp)]
    assert score(case, tools, "auto", right) == {
        "schema_valid": True,
        "right_function": True,
        "exact_args": True,
        "no_call": None,
    }
    wrong_args = [{"name": exp["name"], "arguments": {**exp["arguments"], "city": "Nowhere"}}]
    assert score(case, tools, "required", wrong_args)["exact_args"] is False
    assert score(case, tools, "required", wrong_args)["right_function"] is True
    invalid = [{"name": exp["name"], "arguments": {"town": "Paris"}}]  # not the tool's schema
    assert score(case, tools, "auto", invalid)["schema_valid"] is False
    unparsed = [{"name": exp["name"], "arguments": None}]
    assert score(case, tools, "auto", unparsed)["schema_valid"] is False
    assert score(case, tools, "auto", [])["schema_valid"] is True  # no call is not a malformed call under auto
    assert score(case, tools, "required", [])["schema_valid"] is False  # but required asks for one
    assert score(case, tools, "auto", [])["right_function"] is False
    assert score(none, tools, "auto", []) == {
        "schema_valid": True,
        "right_function": None,
        "exact_args": None,
        "no_call": True,
    }
    assert score(none, tools, "required", [])["no_call"] is None

    # a: right on cases 0-3, b: right on 0 and 4
    recs = lambda hits: [
        {"case": f"c{i}", "mode": "auto", "schema_valid": True, "right_function": i in hits, "exact_args": None,
         "no_call": None}
        for i in range(6)
    ]  # fmt: skip
    a = {"modes": ["auto"], "records": recs({0, 1, 2, 3})}
    b = {"modes": ["auto"], "records": recs({0, 4})}
    assert rates(a["records"])["auto"]["right_function"] == {"hits": 4, "n": 6, "rate": 0.6667}
    got = paired(a, b)["auto"]
    assert got["right_function"]["diff"] == 0.33 and got["right_function"]["n"] == 6
    assert (got["right_function"]["a_only"], got["right_function"]["b_only"]) == (3, 1)
    assert got["right_function"]["mcnemar_p"] == 0.625  # two-sided binomial, 3 of 4 discordant pairs
    lo, hi = got["right_function"]["ci95"]
    assert lo < 0.33 < hi
    assert got["schema_valid"] == {
        "n": 6,
        "diff": 0.0,
        "ci95": [0.0, 0.0],
        "mcnemar_p": 1.0,
        "a_only": 0,
        "b_only": 0,
    }
    assert "exact_args" not in got  # applies to no record


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--target", "kvmem"], "--target: NAME=URL"),
        (["--target", "kvmem=http://127.0.0.1:9", "--modes", "auto,sometimes"], "--modes"),
        (["--target", "kvmem=http://127.0.0.1:9"], "kvmem: http://127.0.0.1:9/v1/models"),
    ],
)
def test_bench_toolcalls_bad_options_are_one_line(args, msg, tmp_path):
    res = kvmem_cli("bench", "toolcalls", *args, "--out", tmp_path, check_rc=2)
    assert res.stderr.startswith("error: ") and msg in res.stderr and "Traceback" not in res.stderr
