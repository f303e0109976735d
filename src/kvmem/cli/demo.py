"""``kvmem demo``: the main job on real input, sized to this machine (README command 1, scripts/demo.sh)."""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import typer

from ..policy import MAX_NEIGHBOURS
from .common import DTYPE, LOCOMO_DATA, LOCOMO_ENV, MODEL, engine_option, friendly


@friendly
def demo(
    file: Path = typer.Argument(LOCOMO_DATA, envvar=LOCOMO_ENV, help="LoCoMo-format JSON."),
    sample: str = typer.Option("conv-26"),
    store: Path | None = typer.Option(
        None, help="Store directory (ingested once, then reused); default .cache/demo-<model>-<dtype>."
    ),
    window: int | None = typer.Option(
        None, help="Encoding window (default: the largest of 5, 3, 2, 1, 0 whose ingest fits --budget on this machine)."
    ),
    k: int = typer.Option(10, "--k"),
    questions: int | None = typer.Option(
        None, help="Questions to answer (categories 1-4, evenly spread; default: as many as fit --budget, 3 to 8)."
    ),
    budget: float = typer.Option(420.0, help="Seconds the main job (ingest + answers) should take here."),
    neighbours: int = typer.Option(
        4,
        "--neighbours",
        min=0,
        max=MAX_NEIGHBOURS,
        help="Neighbour-aware encoding: each fact also behind its m most similar other facts (0 = off).",
    ),
    model: str = MODEL,
    engine: str = engine_option(
        "hf",
        "The demo defaults to hf, unlike every other command (auto): it loads the transformers model anyway to "
        "calibrate and ingest, so hf starts no second engine within --budget.",
    ),
    dtype: str = DTYPE,
):
    """The main job: ingest one LoCoMo conversation, then answer its questions by KV and by prompt injection.

    Its defaults are sized to this machine: a short calibration forward pass measures tokens/s, and the window
    and question count are chosen so the job fits ``--budget``; the choice and the estimate are printed first."""
    from ..engines.select import open_engine
    from ..hardware import choose_dtype, cpu_facts, resolve_dtype
    from ..locomo import answerable, get_conversation
    from ..models import load
    from ..policy import check_neighbours
    from ..retrieve import Embedder
    from ..service import MemoryService, same_prompt
    from ..store import Store, StoreError

    say = functools.partial(typer.echo, err=True)
    dtype = resolve_dtype(dtype)
    conv = get_conversation(file, sample)
    say(f"demo: {model} in {dtype} ({choose_dtype(cpu_facts())[1]}), engine {engine}")
    lm, emb = load(model, dtype=dtype), Embedder()
    store = store or Path(f".cache/demo-{model}-{dtype}")
    have_windows = set()
    try:
        st = Store.open(store)
        if sample in st.reads.users() and st.reads.user_info(sample)["neighbours"] == neighbours:
            have_windows.add(st.reads.user_info(sample)["window"])
        st.close()
    except StoreError:
        pass
    check_neighbours(neighbours)
    est = _demo_estimate(lm, conv, k, neighbours)
    windows = [window] if window is not None else [5, 3, 2, 1, 0]
    ingest_s = (
        {w: est["tokens"][w] / est["tokens_per_s"] for w in windows if w in est["tokens"]}
        if window is None
        else {window: _demo_tokens(lm, conv, window, neighbours) / est["tokens_per_s"]}
    )
    answer_s = est["answer_s"]  # per question, both modes
    if window is None:
        cached = [w for w in windows if w in have_windows]
        window = cached[0] if cached else next((w for w in windows if ingest_s[w] + 3 * answer_s <= budget), 0)
    pending = 0.0 if window in have_windows else ingest_s[window]
    if questions is None:
        questions = int(max(3, min(8, (budget - pending) // max(answer_s, 1e-9))))
    say(f"demo: measured {est['tokens_per_s']:.0f} tokens/s prefill, {est['decode_ms']:.0f} ms/token decode here")
    say(f"demo: store {store}")
    if window in have_windows:
        say(f"demo: reusing {store} ({sample}, w={window})")
    else:
        say(
            f"demo: ingest {sample}: {len(conv.facts)} facts, w={window}, m={neighbours} -> ~{pending:.0f} s here"
            + (
                ""
                if len(ingest_s) < 2
                else " ("
                + ", ".join(f"w={w}: ~{s:.0f} s" for w, s in ingest_s.items())
                + f"; the largest window within --budget {budget:.0f} s)"
            )
        )
    say(f"demo: then {questions} questions x 2 modes at k={k}, ~{questions * answer_s:.0f} s")
    if window not in have_windows:  # replaces this user atomically; other users and stores are untouched
        from ..locomo_ingest import ingest_conversation

        rep = ingest_conversation(lm, emb, store, conv, window, source=str(file), neighbours=neighbours)
        say(f"ingested {rep.num_facts} facts of {sample} (w={window}, m={neighbours}) in {rep.total_s:.1f} s")
    opened = open_engine(lm, engine, dtype, stores=[store])
    if opened.note:
        say(opened.note)
    svc = MemoryService(store, opened.engine, opened.lm, emb)
    qs = answerable(conv.questions)
    step = max(1, len(qs) // max(questions, 1))
    ttft = {"kv": [], "prompt": []}
    for q in qs[::step][:questions]:
        kv = svc.ask(sample, q.question, k, "kv")
        pr = svc.ask(sample, q.question, k, "prompt")
        same_prompt(kv, pr)
        ttft["kv"].append(kv.timings_ms["ttft"])
        ttft["prompt"].append(pr.timings_ms["ttft"])
        typer.echo(f"\nQ ({q.category}): {q.question}\n  reference: {q.answer}")
        for a in (kv, pr):
            typer.echo(
                f"  {a.mode:6s}: {a.answer!r:60s} ttft {a.timings_ms['ttft']:7.1f} ms  "
                f"total {a.timings_ms['total']:7.1f} ms  prefilled {a.prefilled_tokens}/{a.prompt_tokens}"
            )
    med = {m: statistics.median(v) for m, v in ttft.items()}
    typer.echo(
        f"\nmedian ttft at k={k} ({svc.engine.name}, {dtype}, w={window}): kv {med['kv']:.1f} ms, "
        f"prompt {med['prompt']:.1f} ms ({med['prompt'] / med['kv']:.2f}x)"
    )


def _demo_tokens(lm, conv, window: int, neighbours: int = 0) -> int:
    """Tokens ingest runs through the model: ``[header][window][fact]`` per fact, plus about ``neighbours`` mean
    fact lengths per fact for neighbour-aware encoding."""
    from ..compose import PromptFormat
    from ..locomo_ingest import context_sequences

    tok = lm.tokenizer
    seqs, spans = context_sequences(tok, PromptFormat.for_tokenizer(tok, lm.chat).header_ids(tok), conv, window)
    return sum(map(len, seqs)) + min(neighbours, max(len(spans) - 1, 0)) * sum(e - s for s, e in spans)


def _demo_estimate(lm, conv, k: int, neighbours: int = 0) -> dict:
    """Calibrate on this machine: prefill tokens/s (one 512-token forward) and decode ms/token (one 1-token
    forward), then the encoded tokens per window and the seconds one question takes in both modes."""
    import time

    import torch

    base = getattr(lm.model, "model", lm.model)
    ids = torch.randint(100, 1000, (1, 512))
    with torch.inference_mode():
        base(input_ids=ids, use_cache=False)  # warm-up at the timed shapes: the first calls pay one-off set-up
        lm.model(input_ids=ids[:, :1], use_cache=False)
        t0 = time.perf_counter()
        base(input_ids=ids, use_cache=False)
        t1 = time.perf_counter()
        lm.model(input_ids=ids[:, :1], use_cache=False)
        t2 = time.perf_counter()
    tps, decode_s = 512 / (t1 - t0), t2 - t1
    fact_tokens = sum(len(lm.tokenizer(f.render())["input_ids"]) for f in conv.facts) / max(len(conv.facts), 1)
    prompt = 60 + k * fact_tokens  # header + k facts + query
    # both modes: prompt injection prefills the whole prompt, KV injection the query; 32 new tokens each at most
    answer_s = prompt / tps + 2 * (32 * decode_s + 30 / tps)
    return {
        "tokens_per_s": tps,
        "decode_ms": decode_s * 1e3,
        "answer_s": answer_s,
        "tokens": {w: _demo_tokens(lm, conv, w, neighbours) for w in (5, 3, 2, 1, 0)},
    }
