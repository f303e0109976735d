import json

import pytest

from kvmem.locomo import LocomoError, answerable, get_conversation, load_locomo


def test_reads_all_samples_and_facts(locomo_path):
    convs = load_locomo(locomo_path)
    assert [c.sample_id for c in convs] == ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44", "conv-49"]
    c26 = convs[0]
    assert len(c26.facts) == 184
    f = c26.facts[0]
    assert f.fact_id == "conv-26/s1/0/0" and f.speaker == "Caroline" and f.source_turn == "D1:3"
    assert f.date == "1:56 pm on 8 May, 2023"
    assert len({x.fact_id for c in convs for x in c.facts}) == sum(len(c.facts) for c in convs)
    assert len(answerable(c26.questions)) == 152


def test_list_evidence_takes_earliest_turn(locomo_path):
    conv = get_conversation(locomo_path, "conv-30")
    fact = next(
        f for f in conv.facts if f.text.startswith("Jon is working on opening a dance studio, with the official")
    )
    assert fact.source_turn == "D15:3"


def test_window_turns_precede_source(locomo_path):
    conv = get_conversation(locomo_path, "conv-26")
    turns = conv.turns_before("D1:3", 5)
    assert [t.dia_id for t in turns] == ["D1:1", "D1:2"]
    assert [t.dia_id for t in conv.turns_before("D2:3", 3)] == ["D1:18", "D2:1", "D2:2"]  # crosses sessions
    assert conv.turns_before("D1:3", 0) == []


def test_bad_files(tmp_path, locomo_path):
    with pytest.raises(LocomoError, match="not found"):
        load_locomo(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LocomoError, match="not valid JSON"):
        load_locomo(bad)
    bad.write_text(json.dumps([{"x": 1}]))
    with pytest.raises(LocomoError, match="not in LoCoMo format"):
        load_locomo(bad)
    with pytest.raises(LocomoError, match="conv-26"):
        get_conversation(locomo_path, "conv-99")


def test_lone_surrogates_are_replaced_in_data_and_refused_in_questions(tmp_path):
    """ "\\ud83d" alone is valid JSON but no tokenizer takes it. Data files get U+FFFD (documented);
    a question gets a clear ValueError (one error line on the CLI)."""
    from kvmem.compose import PromptFormat, check_text

    sample = {
        "sample_id": "s",
        "conversation": {
            "session_1": [{"dia_id": "D1:1", "speaker": "A", "text": "hi \\ud83d there"}],
            "session_1_date_time": "d",
        },
        "observation": {"session_1_observation": {"A": [["A likes \\ud83d tea", "D1:1"]]}},
        "qa": [],
    }
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(sample).replace("\\\\ud83d", "\\ud83d"))
    assert "\\ud83d" in path.read_text()  # the raw escape is in the file
    (conv,) = load_locomo(path)
    assert conv.facts[0].text == "A likes \ufffd tea" and conv.turns[0].text == "hi \ufffd there"
    fmt = PromptFormat("h", "Q: ", "\nA:")
    with pytest.raises(ValueError, match="the question is not valid Unicode: a lone surrogate U\\+D83D"):
        fmt.query_ids(None, "when \ud83d?")
    assert check_text("fine 😀") == "fine 😀"
