"""specvocab.engine.jobs.frequency: FR-Spec frequency lists from the training corpus (never the benchmark), EOS and the chat
template's specials always kept, the true size when K exceeds the tokens seen, the target's own generations,
SGLang's token map and EAGLE-3's d2t / t2d exports, and the CLI."""

import contextlib
import dataclasses
import json
import re
from collections import Counter

import numpy as np
import pytest
import torch

from specvocab.engine.jobs.calibrate import calibration_prompts
from specvocab.engine.config import SpecConfig
from specvocab.engine.jobs.frequency import (CORPORA, DEFAULT_CORPORA, corpus_texts, default_frequency_file, frequency_list,
                                   generation_arrays, kept_special_ids, main, ranking_from_texts, read_texts,
                                   target_generations, tokenize_texts, write_frequency_lists)
from specvocab.engine.vocab.frspec import (FrequencyError, eagle3_maps, load_eagle3_maps, load_token_map, save_eagle3_maps,
                                 save_token_map)
from specvocab.engine.harness import generate
from specvocab.engine.models import eos_token_ids, load_random_model
from specvocab.engine.prompts import DATA_ENV, ByteTokenizer, Prompt, encode_prompt, load_prompts
from specvocab.engine.vocab import FrSpecVocab, VocabError
from specvocab.locality.shortlist import count_tokens, load_ranking, save_ranking
from specvocab.locality.trace import Trace


class ChatBytes:
    """A Hugging Face-like ChatML tokenizer: ids 0..255 are bytes; <|endoftext|> = 256 (special, unused by the
    template), <|im_start|> = 257 and <|im_end|> = 258 (EOS) written by the chat template; 259 ids."""

    SPECIAL = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    eos_token_id = 258
    all_special_ids = [256, 257, 258]
    added_tokens_decoder: dict = {}
    chat_template = "chatml"

    def _enc(self, text):
        out = []
        for part in re.split("(<\\|endoftext\\|>|<\\|im_start\\|>|<\\|im_end\\|>)", text):
            out += [self.SPECIAL[part]] if part in self.SPECIAL else list(part.encode())
        return out

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": self._enc(texts) if isinstance(texts, str) else [self._enc(t) for t in texts]}

    def encode(self, text, add_special_tokens=False):
        return self._enc(text)

    def batch_decode(self, rows):
        return [bytes(i for i in r if i < 256).decode(errors="replace") for r in rows]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


TRAIN_ROWS = [
    {"id": "t1", "source": "x", "license": "MIT", "language": "en", "task": "math", "prompt": "add 2 and 2",
     "response": "four"},
    {"id": "t2", "source": "x", "license": "MIT", "language": "de", "task": "qa", "prompt": "wer?", "response": None},
    {"id": "t3", "source": "x", "license": "MIT", "language": "en", "task": "code", "prompt": "def f(): pass",
     "response": "ok"},
]
BENCH_ROWS = [{"question_id": 1, "category": "qa", "turns": ["§§§ only in the benchmark ~~~"]}]


@pytest.fixture()
def data(tmp_path, monkeypatch):
    """A small data root: a training corpus and a benchmark whose characters § and ~ the corpus never holds."""
    root = tmp_path / "data"
    for folder, file, rows in (("train_corpus", "prompts.jsonl", TRAIN_ROWS),
                               ("spec_bench", "question.jsonl", BENCH_ROWS)):
        (root / folder).mkdir(parents=True)
        (root / folder / file).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv(DATA_ENV, str(root))
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    return root


# --- texts ----------------------------------------------------------------------------------------------------

class WordTokenizer:
    """Ids of whitespace words, BOS = 0 when add_special_tokens."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        ids = [self.ids.setdefault(w, len(self.ids) + 1) for w in text.split()]
        return ([0] if add_special_tokens else []) + ids


def test_ranking_from_texts_equals_a_counter_over_the_tokenised_texts():
    texts = ["the cat sat on the mat", "the end", "", "cat cat dog the"]
    for tok in (WordTokenizer(), ByteTokenizer(), ChatBytes(), (lambda t: [len(w) for w in t.split()])):
        ids = [i for a in tokenize_texts(texts, tok) for i in a.tolist()]
        r = ranking_from_texts(texts, tok, vocab_size=260)
        assert r.height == 260
        assert {t: c for t, c in zip(r["token_id"], r["count"]) if c} == dict(Counter(ids))
        assert r["token_id"][0] == Counter(ids).most_common(1)[0][0]
    # the batched Hugging Face path and the one-text path agree
    assert [a.tolist() for a in tokenize_texts(texts, ChatBytes(), batch=3)] == [ChatBytes().encode(t) for t in texts]
    # special tokens are not counted (a BOS per text would top every ranking)
    assert 0 not in {t for t, c in zip(*ranking_from_texts(texts, WordTokenizer(), 16)[["token_id", "count"]]) if c}


def test_ranking_from_texts_refuses_a_tokenizer_the_vocab_does_not_fit():
    with pytest.raises(FrequencyError, match=r"token id 195 is outside the vocabulary \[0, 128\)"):
        ranking_from_texts(["plain ascii", "é"], ByteTokenizer(), vocab_size=128)   # é = bytes 195 169
    with pytest.raises(FrequencyError, match="not a str"):
        ranking_from_texts([["a list"]], ByteTokenizer(), vocab_size=256)
    with pytest.raises(FrequencyError, match="no encode"):
        ranking_from_texts(["x"], object(), vocab_size=256)


def test_read_texts_dotted_fields(tmp_path):
    rows = [{"turns": ["a", "b"], "choices": [{"turns": ["x", "y"]}, {"turns": ["z"]}], "text": "t1"},
            {"turns": ["c"], "choices": [], "text": "t2"}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_texts(path) == ["a", "b", "c"]
    assert read_texts(path, "text") == ["t1", "t2"]
    assert read_texts(path, "choices.*.turns") == ["x", "y", "z"]
    with pytest.raises(FrequencyError, match="line 2.*index 0"):
        read_texts(path, "choices.0.turns")                   # row 2 has no choice 0
    with pytest.raises(FrequencyError, match="no field 'body'"):
        read_texts(path, "body")
    with pytest.raises(FrequencyError, match="holds a dict, not text"):
        read_texts(path, "choices.*")
    path.write_text('{"turns": ["ok"]}\nnot json\n')
    with pytest.raises(FrequencyError, match="line 2 is not JSON"):
        read_texts(path)


def test_corpus_texts_are_the_training_prompts_and_their_references(data):
    assert DEFAULT_CORPORA == ("train_corpus",)
    assert corpus_texts() == ["add 2 and 2", "four", "wer?", "def f(): pass", "ok"]
    assert corpus_texts(responses=False) == ["add 2 and 2", "wer?", "def f(): pass"]
    assert corpus_texts(languages=["en"], tasks=["code"]) == ["def f(): pass", "ok"]
    with pytest.raises(FrequencyError, match="unknown corpus 'slimpajama'"):
        corpus_texts("slimpajama")
    with pytest.raises(FrequencyError, match="filter only the train_corpus"):
        corpus_texts("multilingual", languages=["de"])


# --- the list: specials kept, never-seen ids left out ----------------------------------------------------------

def test_kept_specials_are_eos_and_the_templates_own():
    assert kept_special_ids(ChatBytes()) == [257, 258]              # <|endoftext|> is special but never written
    assert kept_special_ids(ChatBytes(), eos_ids=[7]) == [7, 257, 258]
    base = ChatBytes()
    base.chat_template = None
    assert kept_special_ids(base) == [258]                          # a base model keeps its EOS
    assert kept_special_ids(None, eos_ids=[3]) == [3] and kept_special_ids(ByteTokenizer()) == []


def test_frequency_list_keeps_the_specials_first_and_leaves_unseen_ids_out():
    ranking = count_tokens([np.array([4, 2, 2, 4, 7, 9])], vocab_size=12)
    ids = frequency_list(ranking, keep=[11, 4])
    assert ids.tolist() == [11, 4, 2, 7, 9]                         # 11 never seen but kept; 0,1,3,... absent
    assert frequency_list(ranking).tolist() == [4, 2, 7, 9]
    with pytest.raises(FrequencyError, match="outside the vocabulary of 12"):
        frequency_list(ranking, keep=[12])


def test_default_list_is_counted_on_the_training_corpus_and_keeps_eos(data, tmp_path, capsys):
    tok = ChatBytes()
    path = default_frequency_file(tok, "chatbytes", 300)
    assert path.parent == tmp_path / "cache" / "rankings" and "train_corpus" in path.name
    ids = load_token_map(path, tokenizer="chatbytes", vocab_size=300)
    corpus = Counter(b for r in TRAIN_ROWS for t in (r["prompt"], r["response"]) if t for b in t.encode())
    assert ids[:2].tolist() == [257, 258]                            # EOS and <|im_start|>, never in the corpus
    assert sorted(ids[2:].tolist()) == sorted(corpus)                # every byte the corpus showed, nothing else
    assert [corpus[i] for i in ids[2:]] == sorted(corpus.values(), reverse=True)
    assert not {ord("§") & 0xff, ord("~")} & set(ids.tolist())        # the benchmark's text is not counted
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    assert meta["corpora"] == ["train_corpus"] and "train_corpus" in meta["source"]
    assert meta["seen"] == len(corpus) and meta["size"] == len(corpus) + 2 and meta["kept"] == [257, 258]
    ranking = load_ranking(path.parent / meta["ranking"], tokenizer="chatbytes", vocab_size=300)
    assert dict((t, c) for t, c in zip(ranking["token_id"], ranking["count"]) if c) == dict(corpus)
    out = capsys.readouterr().out
    assert "counted" in out and f"= {len(corpus) + 2} ids" in out
    mtime = path.stat().st_mtime_ns
    assert default_frequency_file(tok, "chatbytes", 300) == path and path.stat().st_mtime_ns == mtime
    assert "cached" in capsys.readouterr().out
    assert default_frequency_file(tok, "chatbytes", 320, verbose=False) != path      # another size, another file
    with pytest.raises(FrequencyError, match="evaluation set.*rest_vicuna7b_mtbench"):
        default_frequency_file(tok, "chatbytes", 300, corpora=("rest_vicuna7b_mtbench",))
    with pytest.raises(FrequencyError, match="unknown corpus"):
        default_frequency_file(tok, "chatbytes", 300, corpora=("slimpajama",))
    assert set(DEFAULT_CORPORA) <= set(CORPORA)


def test_frspec_policy_on_the_default_list_has_the_true_size_and_eos(data):
    path = default_frequency_file(ChatBytes(), "chatbytes", 300, verbose=False)
    ids = load_token_map(path)
    weight = torch.randn(300, 8)
    small = FrSpecVocab(weight, SpecConfig(vocab="frspec", frspec_k=4, frequency_file=str(path)))
    assert 258 in small.ids.tolist() and small.ids.tolist() == ids[:4].tolist()
    with pytest.warns(UserWarning, match=f"true size is {ids.size}"):
        big = FrSpecVocab(weight, SpecConfig(vocab="frspec", frspec_k=32768, frequency_file=str(path)))
    assert big.k == big.active_size() == ids.size < 300              # not padded with never-seen ids by id
    # a locality ranking (every id, unseen ones last) is read the same way: unseen ids are not ranked
    rk = save_ranking(count_tokens([np.array([5, 5, 6])], 300), data / "r.parquet", tokenizer="chatbytes")
    with pytest.warns(UserWarning, match="true size is 2"):
        unseen = FrSpecVocab(weight, SpecConfig(vocab="frspec", frspec_k=100, frequency_file=str(rk)))
    assert unseen.ids.tolist() == [5, 6]


# --- the target's own generations --------------------------------------------------------------------------------

def test_target_generations_are_the_greedy_decode_and_refuse_benchmark_prompts():
    model, tok, info = load_random_model("random-llama", seed=3)
    prompts = [Prompt("train_corpus", f"p{i}", "qa", "en", (text,)) for i, text in enumerate(["hello there", "abc"])]
    got = target_generations(model, tok, info, prompts, max_new_tokens=6, eos_ids=[], progress=False)
    for p, g in zip(prompts, got):
        ids = encode_prompt(tok, info, p.turns, [], max_new_tokens=6)
        assert g.tolist() == generate(model, ids, method="ar", max_new_tokens=6, eos_ids=[]).output_ids.tolist()
    with pytest.raises(FrequencyError, match="evaluation set.*spec_bench.*fitted on the prompts it is evaluated on"):
        target_generations(model, tok, info, [Prompt("spec_bench", "1", "qa", "en", ("x",))], progress=False)


def test_generation_arrays_count_training_traces_only():
    def trace(prompt_set, tokenizer="smollm2"):
        return Trace(prompt=np.array([1, 2]), prefill_topk=np.zeros((1, 1), dtype=np.int64),
                     generated=np.array([5, 6, 5]), step_topk=np.zeros((3, 1), dtype=np.int64),
                     meta={"prompt_set": prompt_set, "tokenizer": tokenizer})
    assert [a.tolist() for a in generation_arrays([trace("train_corpus")], "smollm2")] == [[5, 6, 5]]
    with pytest.raises(FrequencyError, match="evaluation set.*spec_bench"):
        generation_arrays([trace("train_corpus"), trace("spec_bench")])
    with pytest.raises(FrequencyError, match="tokenizer.*gemma3.*not 'smollm2'"):
        generation_arrays([trace("train_corpus", "gemma3")], "smollm2")


# --- exports: SGLang's token map and EAGLE-3's d2t / t2d ---------------------------------------------------------

def test_token_map_is_sglangs_convention_and_refuses_another_vocabulary(tmp_path):
    ids = np.array([258, 32, 101, 7, 200])
    path = save_token_map(ids, tmp_path / "map.pt", tokenizer="chatbytes", vocab_size=300)
    raw = torch.load(path, weights_only=True)                       # what SGLang's load_token_map does
    assert isinstance(raw, list) and all(type(i) is int for i in raw)
    assert torch.tensor(raw, dtype=torch.int64).tolist() == ids.tolist()
    assert load_token_map(path, tokenizer="chatbytes", vocab_size=300).tolist() == ids.tolist()
    with pytest.raises(FrequencyError, match="tokenizer 'chatbytes', not 'llama3'.*Count a list with 'llama3'"):
        load_token_map(path, tokenizer="llama3")
    with pytest.raises(FrequencyError, match="vocabulary of 300 ids but the target has 128256"):
        load_token_map(path, vocab_size=128256)
    # a bare list without a sidecar (e.g. FR-Spec's released files) still has its ids checked
    torch.save([1, 2, 999], tmp_path / "bare.pt")
    with pytest.raises(FrequencyError, match="token id 999 is outside the vocabulary of 300"):
        load_token_map(tmp_path / "bare.pt", vocab_size=300)
    with pytest.raises(FrequencyError, match="repeats"):
        save_token_map([3, 3], tmp_path / "x.pt", tokenizer="t", vocab_size=10)


def test_eagle3_maps_follow_the_d2t_t2d_convention(tmp_path):
    ids = np.array([258, 32, 101, 7, 200, 0])                       # most frequent first
    d2t, t2d = eagle3_maps(ids, 300)
    target = torch.arange(ids.size) + d2t                           # target id = draft id + d2t[draft id]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (300,)
    assert target.tolist() == sorted(ids.tolist())                  # draft ids in ascending target-id order
    assert int(t2d.sum()) == ids.size and t2d[target].all() and torch.nonzero(t2d).flatten().tolist() == target.tolist()
    path = save_eagle3_maps(ids, tmp_path / "e3.pt", tokenizer="chatbytes", vocab_size=300)
    d2t_back, t2d_back = load_eagle3_maps(path, tokenizer="chatbytes", vocab_size=300)
    assert torch.equal(d2t_back, d2t) and torch.equal(t2d_back, t2d)
    with pytest.raises(FrequencyError, match="vocabulary of 300 ids but the target has 262144"):
        load_eagle3_maps(path, vocab_size=262144)
    with pytest.raises(FrequencyError, match="tokenizer 'chatbytes', not 'gemma3'"):
        load_eagle3_maps(path, tokenizer="gemma3")
    torch.save({"d2t": d2t, "t2d": t2d}, tmp_path / "bare.pt")      # an EAGLE-3 cache.pt of another vocabulary
    with pytest.raises(FrequencyError, match="t2d covers 300 target ids but the target has 512"):
        load_eagle3_maps(tmp_path / "bare.pt", vocab_size=512)
    bad = t2d.clone()
    bad[1] = True                                                   # t2d names one id more than d2t
    torch.save({"d2t": d2t, "t2d": bad}, tmp_path / "bad.pt")
    with pytest.raises(FrequencyError, match="d2t and t2d disagree"):
        load_eagle3_maps(tmp_path / "bad.pt")


def test_lists_of_several_sizes_load_in_the_frspec_policy_and_report_the_true_size(tmp_path, capsys):
    ids = np.array([258, 257] + list(range(40, 90)))                # 52 ids ranked
    files = write_frequency_lists(ids, tmp_path, tokenizer="chatbytes", vocab_size=300, sizes=[8, 16, 64])
    out = capsys.readouterr().out
    assert "K=64 exceeds the 52 tokens the corpus supports: true size 52" in out
    weight = torch.randn(300, 4)
    for k, f in files.items():
        meta = json.loads(f["frspec"].with_name(f["frspec"].name + ".json").read_text())
        assert meta["requested_k"] == k and meta["size"] == min(k, 52) and meta["list_size"] == 52
        with pytest.warns(UserWarning, match="true size is 52") if k > 52 else contextlib.nullcontext():
            policy = FrSpecVocab(weight, SpecConfig(vocab="frspec", frspec_k=k, frequency_file=str(f["frspec"])))
        assert policy.ids.tolist() == ids[:k].tolist() and 258 in policy.ids.tolist()
        d2t, t2d = load_eagle3_maps(f["eagle3"], tokenizer="chatbytes", vocab_size=300)
        assert int(t2d.sum()) == d2t.numel() == min(k, 52)
    with pytest.raises(VocabError, match="made for a vocabulary of 300 ids but the model has 512"):
        FrSpecVocab(torch.randn(512, 4), SpecConfig(vocab="frspec", frequency_file=str(files[8]["frspec"])))
    with pytest.raises(FrequencyError, match="unknown export"):
        write_frequency_lists(ids, tmp_path, tokenizer="t", vocab_size=300, sizes=[4], exports=["vllm"])


# --- calibration is fitted on the training corpus too ----------------------------------------------------------

def test_calibration_prompts_come_from_the_training_corpus():
    info = dataclasses.replace(load_random_model("random-llama")[2], max_context=10**6)   # byte prompts of any length
    cal, warm = calibration_prompts(None, info, n=5, warmup=2, max_new_tokens=8)
    assert len(cal) == 5 and len(warm) == 2
    train = {tuple(encode_prompt(None, info, p.turns[:1], [])) for p in load_prompts("train_corpus", languages=["en"])}
    bench = {tuple(encode_prompt(None, info, p.turns[:1], [])) for p in load_prompts("spec_bench")}
    got = {tuple(t.tolist()) for t in cal + warm}
    assert len(got) == 7 and got <= train and not got & bench


# --- CLI -------------------------------------------------------------------------------------------------------

def test_cli_counts_the_corpus_texts_and_generations(data, tmp_path, capsys):
    texts = tmp_path / "extra.jsonl"
    texts.write_text("\n".join(json.dumps({"doc": {"text": t}}) for t in ["hello world", "hello again"]))
    files = main(["--model", "random-llama", "--texts", str(texts), "--text-field", "doc.text", "--generations", "2",
                  "--max-new-tokens", "5", "--sizes", "4", "600", "--out-dir", str(tmp_path / "out")])
    ranking = load_ranking(tmp_path / "out" / "ranking.parquet", tokenizer="bytes", vocab_size=512)
    model, _, info = load_random_model("random-llama")
    pool = load_prompts("train_corpus")
    pick = sorted(np.random.default_rng(0).permutation(len(pool))[:2].tolist())    # the CLI's seeded draw
    gen = [generate(model, encode_prompt(None, info, pool[i].turns, [], max_new_tokens=5), method="ar",
                    max_new_tokens=5, info=info).output_ids.tolist() for i in pick]
    corpus = [b for t in corpus_texts() + ["hello world", "hello again"] for b in t.encode()]
    expect = Counter(corpus + [t for g in gen for t in g])
    assert dict((t, c) for t, c in zip(ranking["token_id"], ranking["count"]) if c) == dict(expect)
    source = json.loads((tmp_path / "out" / "ranking.parquet.json").read_text())["source"]
    assert "train_corpus" in source and "greedy continuations of 2 train_corpus prompts" in source
    ids = load_token_map(files[4]["frspec"], tokenizer="bytes", vocab_size=512)
    eos = eos_token_ids(model, None)                                # the model's EOS is kept first
    assert eos and ids.tolist() == frequency_list(ranking, keep=eos).tolist()[:4] and ids[0] == eos[0]
    assert json.loads(files[600]["frspec"].with_name("frspec-k600.pt.json").read_text())["size"] == \
        int((ranking["count"] > 0).sum()) + len(set(eos) - set(expect))
    assert files[600]["eagle3"].exists()
    with pytest.raises(FrequencyError, match="evaluation set"):
        main(["--model", "random-llama", "--corpus", "multilingual", "--out-dir", str(tmp_path / "o2")])
    with pytest.raises(SystemExit):
        main(["--model", "random-llama", "--corpus", "--out-dir", str(tmp_path / "o3")])
    assert "nothing to count" in capsys.readouterr().err


# --- the real corpus with a real tokenizer (slow) --------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_default_list_keeps_chatml_and_reports_the_true_size(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    _, tok, info = smollm2
    path = default_frequency_file(tok, info.tokenizer_name, info.vocab_size, verbose=False)
    ids = load_token_map(path, tokenizer=info.tokenizer_name, vocab_size=info.vocab_size)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[:2].tolist() == sorted([im_start, im_end]) and tok.eos_token_id == im_end
    assert 20_000 < ids.size < info.vocab_size                       # K = 64k or 32k+ is clipped, not padded
    sample = corpus_texts("train_corpus", languages=["en"], tasks=["code"])[:20]
    assert set(np.concatenate(tokenize_texts(sample, tok)).tolist()) <= set(ids.tolist())
