"""``/ui``, the memory inspector, in a real browser: Debian's headless Chromium driven by Playwright against
``kvmem serve`` (transformers engine, smollm2, fp32) on a loopback port. One server and one browser for the
module. Each page is clicked through and what it shows is asserted (counts, texts, scores, the erasure report,
both answers of Ask), and so are the safety rules: memory text is text (no script runs), the
Content-Security-Policy, a POST without the session's CSRF token refused, the API key in no URL, page or cookie,
and another tenant sees nothing.

``KVMEM_SCREENSHOTS=docs/images pytest -m browser tests/test_ui.py`` also writes a screenshot of each page there
(the pictures in docs/usage.md and docs/server.md)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import http_server
from kvmem.models import MANIFEST, model_dir

pytestmark = pytest.mark.browser

FAST = "smollm2-135m-instruct"
KEY_A, KEY_B = "key-acme-0123456789abcdef", "key-globex-0123456789abcdef"
XSS = '<script>window.__xss = 1</script><img src="x" onerror="window.__xss = 2"> likes "quotes" & <b>tags</b>'
SHOTS = os.environ.get("KVMEM_SCREENSHOTS")


def _h(key=KEY_A):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvmem.server import KvmemServer, Limits

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    srv = KvmemServer.start(
        tmp_path_factory.mktemp("ui") / "store",
        model=FAST,
        engine="hf",
        dtype="float32",
        window=2,
        api_keys={KEY_A: "acme", KEY_B: "globex"},
        limits=Limits(default_max_tokens=8),
    )
    with http_server(srv) as base:
        yield srv, base


@pytest.fixture(scope="module")
def data(server):
    """Tenant acme: alice with a conversation of three turns (three memories, each encoded behind the turns
    before it), one memory with metadata in an agent scope, and the XSS canary; bob with one memory. Tenant
    globex: carol."""
    _, base = server

    def add(body, key=KEY_A):
        r = httpx.post(f"{base}/v1/memories", headers=_h(key), json={"infer": False, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return [e["id"] for e in r.json()["results"]]

    turns = [
        {"role": "user", "content": "I adopted a grey cat named Pixel in March."},
        {"role": "user", "content": "I work as a nurse at the city hospital."},
        {"role": "user", "content": "My favourite food is mushroom risotto."},
    ]
    ids = dict(zip(["cat", "job", "food"], add({"messages": turns, "user_id": "alice"})))
    [ids["trip"]] = add(
        {"messages": "Alice plans a trip to Porto in May.", "user_id": "alice", "agent_id": "travel",
         "metadata": {"topic": "travel"}}
    )  # fmt: skip
    [ids["xss"]] = add({"messages": XSS, "user_id": "alice"})
    [ids["bob"]] = add({"messages": "Bob plays the cello.", "user_id": "bob"})
    [ids["carol"]] = add({"messages": "Carol keeps bees.", "user_id": "carol"}, KEY_B)
    return ids


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: run scripts/setup.sh")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed: scripts/setup.sh installs it (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


def _shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"ui-{name}.png"), full_page=True)


def _signed_in(browser, base, key=KEY_A):
    ctx = browser.new_context(base_url=base, viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    page.goto("/ui")
    assert page.url.endswith("/ui/login")
    page.fill("#api-key", key)
    page.click("#sign-in")
    assert page.url.endswith("/ui/users")
    return ctx, page


def _cells(page, selector: str) -> list[str]:
    return [t.strip() for t in page.locator(selector).all_inner_texts()]


def test_sign_in_users_memories_provenance_and_turns(server, data, browser):
    _, base = server
    ctx = browser.new_context(base_url=base, viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    page.goto("/ui/users")
    assert page.url.endswith("/ui/login")  # no session: sign in first
    _shot(page, "login")
    page.fill("#api-key", "not-a-key-of-this-server")
    page.click("#sign-in")
    assert "not valid" in page.inner_text("#message")
    page.fill("#api-key", KEY_A)
    page.click("#sign-in")
    assert page.url.endswith("/ui/users") and page.inner_text("#tenant") == "acme"
    # the tenant's users with their memory counts (alice's agent scope counted with her), KV bytes, activity
    assert _cells(page, "#users td a.user") == ["alice", "bob"]
    assert _cells(page, "#users td.count") == ["5", "1"]
    assert page.inner_text("#user-total") == "2 users"
    _shot(page, "users")
    page.fill("#user-search", "BO")
    page.press("#user-search", "Enter")
    assert _cells(page, "#users td a.user") == ["bob"] and page.inner_text("#user-total").startswith("1 user")
    # alice's memories: texts, scope, metadata, KV bytes; provenance links to the turns and facts
    page.goto("/ui/users/alice")
    assert page.inner_text("#memory-total") == "5"
    texts = _cells(page, "#memories a.memory")
    assert "I adopted a grey cat named Pixel in March." in texts and "Alice plans a trip to Porto in May." in texts
    trip = page.locator(f"#m-{data['trip']}")
    assert "agent travel" in trip.inner_text() and '"topic": "travel"' in trip.inner_text()
    assert re.search(r"\d+(\.\d)? KB", page.locator(f"#m-{data['food']}").inner_text())
    _shot(page, "memories")
    food = page.locator(f"#m-{data['food']}")
    assert _cells(food.locator("a.turn").first, ":scope") == ["turn 2"]  # came from its own turn
    food.locator("a.turn").nth(1).click()  # encoded behind turn 0 (window 2)
    assert "/ui/users/alice/turns" in page.url and page.url.endswith("#turn-0")
    assert page.inner_text("#turn-0").endswith("I adopted a grey cat named Pixel in March.")
    assert len(_cells(page, "#turns li")) == 4  # the conversation and the canary; the agent scope has its own
    _shot(page, "turns")
    ctx.close()


def test_memory_text_is_text_and_csp_forbids_inline_script(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    resp = page.goto("/ui/users/alice")
    csp = resp.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert page.locator(f"#m-{data['xss']} a.memory").inner_text() == XSS  # shown as the characters it holds
    assert page.evaluate("window.__xss") is None and page.locator("#memories img").count() == 0
    page.goto(f"/ui/memories/{data['xss']}")
    assert page.inner_text("#memory-text") == XSS and page.evaluate("window.__xss") is None
    assert "<script>window.__xss" not in page.content()  # escaped in the HTML itself
    assert errors == []
    ctx.close()


def test_history_search_scores_and_what_a_chat_injects(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base)
    httpx.put(f"{base}/v1/memories/{data['job']}", headers=_h(), json={"text": "I work as a nurse at the clinic."})
    page.goto(f"/ui/memories/{data['job']}")
    assert page.inner_text("#memory-text") == "I work as a nurse at the clinic."
    rows = [r.split("\t") for r in _cells(page, "#history tbody tr")]
    assert [r[0] for r in rows] == ["ADD", "UPDATE"]
    assert rows[1][1] == "I work as a nurse at the city hospital." and rows[1][2] == "I work as a nurse at the clinic."
    _shot(page, "memory")
    page.goto("/ui/search?user_id=alice")
    page.fill("#query", "What is my cat called?")
    page.fill("#k", "2")
    page.click("#search")
    first = page.locator("#results tbody tr").first.inner_text()
    assert "Pixel" in first
    api = httpx.post(
        f"{base}/v1/memories/search", headers=_h(),
        json={"query": "What is my cat called?", "user_id": "alice", "top_k": 2, "explain": True},
    ).json()["results"]  # fmt: skip
    assert _cells(page, "#results td.score") == [f"{r['score']:.4f}" for r in api]  # the API's scores
    cos = f"{api[0]['score_details']['semantic_score']:.4f}"
    assert cos in first
    injected = _cells(page, "#injected li")
    assert len(injected) == 2 and "I adopted a grey cat named Pixel in March." in injected
    assert "Alice plans a trip to Porto in May." not in injected  # the agent scope: not in a chat naming alice alone
    _shot(page, "search")
    ctx.close()


def test_delete_preview_report_and_erased_history(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base)
    page.goto(f"/ui/memories/{data['cat']}")
    page.click("#delete")
    remove = _cells(page, "#preview-remove li")
    assert len(remove) == 2 and remove[1] == "turn 0, which it came from: I adopted a grey cat named Pixel in March."
    reencode = _cells(page, "#preview-reencode li")  # encoded behind turn 0 (window 2)
    assert "My favourite food is mushroom risotto." in reencode
    _shot(page, "delete-preview")
    page.click("#confirm-delete")
    report = {k: page.inner_text(f"#{k}") for k in ("erased", "turns", "reencoded", "deferred")}
    assert report == {"erased": "1", "turns": "1", "reencoded": str(len(reencode)), "deferred": "0"}
    _shot(page, "erasure-report")
    page.click("#history-link")
    assert page.inner_text("#erased-note") == "erased"
    rows = [r.split("\t") for r in _cells(page, "#history tbody tr")]
    assert [r[0] for r in rows] == ["ADD", "DELETE"] and rows[0][2] == "erased"  # its text went with it
    assert "Pixel" not in page.content()
    page.goto("/ui/users/alice")
    assert page.inner_text("#memory-total") == "4"
    ctx.close()


def test_ask_answers_in_kv_and_prompt_mode(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base)
    page.goto("/ui/ask?user_id=alice")
    page.fill("#question", "What food do I like?")
    page.fill("#k", "3")
    page.click("#ask")
    kv, prompt = page.locator("#answer-kv"), page.locator("#answer-prompt")
    facts_kv, facts_prompt = _cells(kv, ".facts li"), _cells(prompt, ".facts li")
    assert facts_kv == facts_prompt and len(facts_kv) == 3 and "My favourite food is mushroom risotto." in facts_kv
    assert kv.locator(".reply").inner_text() == prompt.locator(".reply").inner_text()  # fp32: exact injection
    pre_kv, pre_prompt = int(kv.locator(".prefilled").inner_text()), int(prompt.locator(".prefilled").inner_text())
    assert pre_kv < pre_prompt  # kv mode prefills the question only
    assert float(kv.locator(".ttft").inner_text().split()[0]) > 0
    _shot(page, "ask")
    ctx.close()


def test_csrf_less_post_refused_and_key_never_shown(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base)
    assert KEY_A not in page.url and KEY_A not in page.content()
    cookies = ctx.cookies()
    session = next(c for c in cookies if c["name"] == "kvmem_ui")
    assert session["httpOnly"] and session["sameSite"] == "Strict" and all(KEY_A not in c["value"] for c in cookies)
    assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
    jar = {"kvmem_ui": session["value"]}
    with httpx.Client(base_url=base, cookies=jar) as c:  # a forged cross-site form: the cookie, no token
        r = c.post(f"/ui/memories/{data['bob']}/delete", data={})
        assert r.status_code == 403 and "CSRF" in r.text
        r = c.post("/ui/users/bob/delete", data={"csrf": "guess", "confirm": "bob"})
        assert r.status_code == 403
        assert c.post("/ui/login", data={"api_key": KEY_A}).status_code == 403  # sign-in needs its form's token
    assert httpx.get(f"{base}/v1/memories/{data['bob']}", headers=_h()).status_code == 200  # nothing deleted
    page.click("#sign-out")
    assert page.url.endswith("/ui/login")
    with httpx.Client(base_url=base, cookies=jar) as c:  # the signed-out session is over
        assert c.get("/ui/users").status_code == 303
    ctx.close()


def test_other_tenant_sees_nothing(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base, KEY_B)
    assert page.inner_text("#tenant") == "globex" and _cells(page, "#users td a.user") == ["carol"]
    assert page.goto(f"/ui/memories/{data['bob']}").status == 404
    assert page.goto(f"/ui/memories/{data['bob']}/delete").status == 404
    page.goto("/ui/users/bob")
    assert page.inner_text("#memory-total") == "0"
    page.goto("/ui/search?user_id=bob&q=cello")
    assert _cells(page, "#results td.score") == [] and _cells(page, "#injected li") == ["nothing"]
    page.goto("/ui/users/bob/turns")
    assert _cells(page, "#turns li") == ["No stored turns."]
    ctx.close()


def test_delete_all_needs_the_typed_user_id(server, data, browser):
    _, base = server
    ctx, page = _signed_in(browser, base)
    page.goto("/ui/users/bob")
    page.click("#delete-all")
    assert page.inner_text("#count") == "1"
    page.fill("#confirm", "bo")
    page.click("#confirm-delete-all")
    assert "nothing was deleted" in page.inner_text("#message")
    page.goto("/ui/users/bob/delete")
    page.fill("#confirm", "bob")
    _shot(page, "delete-all")
    page.click("#confirm-delete-all")
    assert page.inner_text("#erased") == "1" and page.inner_text("#turns") == "1"
    page.goto("/ui/users")
    assert _cells(page, "#users td a.user") == ["alice"]
    ctx.close()
