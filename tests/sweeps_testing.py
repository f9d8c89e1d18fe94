"""A tiny sweep for the sweep tests: a random Llama (vocab 512, hidden 64, 2 layers), a few Spec-Bench prompts,
a few tokens, every kind of cell."""

from __future__ import annotations

from pathlib import Path

TINY_MODEL = 'name = "random-llama"\nlabel = "tiny"\noptions = { vocab_size = 512, hidden_size = 64, num_layers = 2 }'


def tiny_toml(*, name: str = "tiny", kinds=("record", "coverage", "bench", "calibrate"), categories=("qa", "writing"),
              max_new_tokens: int = 8, testing: str = "", bench: str | None = None, coverage: str = "",
              extra: str = "", calibration_cache: bool | str = False) -> str:
    """`coverage`: more [coverage] lines; `extra`: more tables at the end. `calibration_cache` defaults to
    false: a test's calibrate cells must not write into the user's calibration cache."""
    bench = bench if bench is not None else '''
[[bench]]
methods = ["ar", "pld", "unispec"]

[[bench]]
methods = ["layerskip"]
policies = ["full", "frspec", "microspec"]
vocab_sizes = [128]
params = { drafter_layers = "first:1" }
'''
    cats = ", ".join(f'"{c}"' for c in categories)
    cache = f'"{calibration_cache}"' if isinstance(calibration_cache, str) else str(calibration_cache).lower()
    text = f'''
[sweep]
name = "{name}"
kinds = [{", ".join(f'"{k}"' for k in kinds)}]
max_new_tokens = {max_new_tokens}
warmup = 0
calibration_cache = {cache}

[[models]]
{TINY_MODEL}

[[prompts]]
set = "spec_bench"
per_category = 1
categories = [{cats}]

[record]
topk = 8

[coverage]
w_max = [64, 256, 1024]
shortlist_k = [64, 256]
capacities = [64, 256]
{coverage}
{bench}
[[calibrate]]
methods = ["unispec"]
grid = [1, 2, 4]
prompts = 2
warmup = 1
max_new_tokens = 8
{extra}
'''
    if testing:
        text += f"\n[testing]\n{testing}\n"
    return text


def write_toml(folder: Path, text: str, name: str = "tiny.toml") -> Path:
    path = Path(folder) / name
    path.write_text(text)
    return path
