"""Training data for draft heads: the target's features over the training corpus, in resumable shards.

**Data** (`make_data`). The target runs over prompts of the training corpus (`train_corpus` in the data root:
disjoint from every benchmark, so nothing is fitted on the prompts it is evaluated on). Per prompt, one sample
per source:
- `teacher`: the prompt followed by the corpus's reference response, teacher forced: one prefill (fast);
- `greedy`: the prompt followed by the target's own greedy continuation (batched `generate`, left-padded),
  then one prefill over the whole sequence - the drafter imitates what it will verify (EAGLE §4; VocabTrim).
A sample stores its token ids, `loss_mask` (1 on response tokens), the target's last hidden states `hidden`
[L, d] (after the final norm: the input of its LM head, what `eagle` reads at decode time), the target's
top-k logits at every position (`topk_ids`, `topk_logits`), and with `eagle3_features` the low / mid / high
layer features an EAGLE-3 head reads (layers 2, L/2 and L-3, as EAGLE-3 picks them). With
`store_features=False` a shard holds the tokens only and a training run computes the features of each batch
with the same prefill (`with_features`): no disk for them, one more target prefill per training token. The
greedy continuations are generated once either way and stored as tokens.

The prefill is batched: sequences sorted by length and grouped into right-padded forwards of up to
`prefill_tokens` tokens (`prefill_groups`), the large-row path of the target (oneDNN GEMMs in the target's
dtype; bf16 on a CPU with bf16 dot products). Samples are grouped into shards `train-NNNNN.safetensors` /
`heldout-NNNNN.safetensors` (a held-out split by prompt, `engine.train.shards`), each written atomically with
its prompt ids in its metadata; `manifest.json` holds the settings. A rerun with the same settings skips every
finished shard, so an interrupted run resumes where it stopped and writes each prompt once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from specvocab.engine.artifacts import FINGERPRINT_KEY, atomic_write, head_fingerprint
from specvocab.engine.drafters.eagle3 import eagle3_feature_layers
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.prompts import Prompt, PromptError, encode_prompt, load_prompts
from specvocab.engine.target import decoder, lm_logits
from specvocab.engine.train.sample import DTYPES, FEATURES, Sample, TrainError, default_data_dir
from specvocab.engine.train.shards import FORMAT, read_manifest, save_shard

SOURCES = ("teacher", "greedy")


@dataclass(frozen=True)
class DataConfig:
    """What `make_data` runs. Defaults are sized for this 2-core CPU; a GPU user raises num_prompts."""

    model: str
    sources: tuple[str, ...] = ("teacher",)  # teacher | greedy (both: one sample of each per prompt)
    prompts: str = "train_corpus"           # the training corpus: disjoint from every benchmark
    languages: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    num_prompts: int | None = 512           # prompts used (held-out ones included); None: every usable prompt
    heldout_prompts: int = 16               # the held-out split (learning curve), the first of the shuffled prompts
    max_tokens: int = 512                   # a sample is cut at this many tokens (prompt + response)
    system_prompt: bool = False             # render prompts with the benchmarks' system prompt (FR-Spec's): off,
                                            # since thousands of copies of one ~100-token preamble teach nothing
    max_prompt_tokens: int = 384            # prompts longer than this are skipped (no room for a response)
    greedy_new_tokens: int = 128            # the target's continuation per prompt (source `greedy`)
    greedy_batch: int = 8                   # prompts per batched `generate`
    prefill_tokens: int = 2048              # sequences per target forward: up to this many tokens (padded)
    prompts_per_shard: int = 32
    topk: int = 16                          # the target's top-k logits stored per position
    eagle3_features: bool = False           # also store the low / mid / high layer features (EAGLE-3 heads)
    feature_dtype: str = "bf16"             # storage of the features: bf16 halves the disk, error ~0.4% of RMS
    store_features: bool = True             # False: shards hold tokens only; training computes the features
    seed: int = 0
    out: str | None = None                  # default: <specvocab cache>/train/<model>
    dtype: str | None = None                # the target's compute dtype (None: the machine's default)
    device: str | None = None
    threads: int | None = None
    progress: bool = True

    def key(self) -> dict:
        """The settings a data folder depends on: a folder holds one of them."""
        keep = ("model", "sources", "prompts", "languages", "tasks", "num_prompts", "heldout_prompts", "max_tokens",
                "max_prompt_tokens", "greedy_new_tokens", "topk", "eagle3_features", "feature_dtype", "seed", "dtype", "system_prompt")
        key = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ((k, getattr(self, k)) for k in keep)}
        if self.eagle3_features:      # the features are the residual stream at layer inputs
            key["eagle3_features_at"] = "layer inputs"
        if not self.store_features:
            key["store_features"] = False
        return key

    def validate(self) -> "DataConfig":
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise TrainError(f"unknown data source(s) {bad or '(none)'} — choose from {list(SOURCES)}")
        if self.feature_dtype not in DTYPES:
            raise TrainError(f"feature_dtype {self.feature_dtype!r}: choose one of {list(DTYPES)}")
        for name in ("max_tokens", "greedy_new_tokens", "greedy_batch", "prompts_per_shard", "topk"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise TrainError(f"num_prompts must be >= 1 (or None for every prompt), got {self.num_prompts}")
        if self.heldout_prompts < 0 or (self.num_prompts is not None and self.heldout_prompts >= self.num_prompts):
            raise TrainError(f"heldout_prompts must be in [0, num_prompts), got {self.heldout_prompts} of "
                             f"{self.num_prompts}")
        return self


@torch.no_grad()
def target_features(model, ids: Sequence[int], *, topk: int, eagle3: bool = False) -> dict[str, torch.Tensor]:
    """One prefill of the target over ids: hidden [L, d] (its LM head's input), top-k logits [L, k] and, with
    eagle3, the three layer features. Tensors on the CPU."""
    return target_features_batch(model, [ids], topk=topk, eagle3=eagle3)[0]


@torch.no_grad()
def target_features_batch(model, seqs: Sequence[Sequence[int]], *, topk: int, eagle3: bool = False,
                          topk_at: Sequence[torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """`target_features` of several sequences in one forward: right-padded, so (causal attention) no real
    position sees a pad and each row's features are its own; pad rows are dropped. Short sequences batched
    run the matmuls at a useful size (the corpus's samples are ~200 tokens). topk_at: per sequence, the
    positions [L] bool whose top-k a loss reads; the LM head runs only there, the other rows' top-k are zeros
    (by default every position)."""
    device = model.get_output_embeddings().weight.device
    width = max(len(q) for q in seqs)
    x = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, q in enumerate(seqs):
        x[r, : len(q)] = torch.as_tensor(list(q))
    out = decoder(model)(input_ids=x.to(device), use_cache=False, output_hidden_states=eagle3)
    res = []
    for r, q in enumerate(seqs):
        hidden = out.last_hidden_state[r, : len(q)]
        at = None if topk_at is None else topk_at[r].to(hidden.device).nonzero().flatten()
        rows = hidden if at is None else hidden[at]
        vals = torch.zeros((rows.shape[0], topk), dtype=torch.float32, device=hidden.device)
        idx = torch.zeros((rows.shape[0], topk), dtype=torch.long, device=hidden.device)
        for a in range(0, rows.shape[0], 256):                     # the LM head in chunks of rows
            v, i = lm_logits(model, rows[a:a + 256]).topk(topk, dim=-1)
            vals[a:a + 256], idx[a:a + 256] = v.float(), i
        if at is not None:
            vals = vals.new_zeros((len(q), topk)).index_copy(0, at, vals)
            idx = idx.new_zeros((len(q), topk)).index_copy(0, at, idx)
        f = {"hidden": hidden.cpu(), "topk_logits": vals.cpu(), "topk_ids": idx.cpu()}
        if eagle3:
            layers = eagle3_feature_layers(len(out.hidden_states) - 1)
            for name, layer in zip(FEATURES, layers):
                # the residual stream ENTERING layer i, as the official EAGLE-3 target forward collects it:
                # HF's hidden_states[i] ([0] is the embedding output, [i] layer i-1's output)
                f[name] = out.hidden_states[layer][r, : len(q)].cpu()
        res.append(f)
    return res


@torch.no_grad()
def greedy_continuations(model, prompts: Sequence[Sequence[int]], new_tokens: int, eos_ids: Sequence[int],
                         pad_id: int = 0) -> list[list[int]]:
    """The target's greedy continuation of each prompt (batched, left-padded), cut after the first eos."""
    device = model.get_output_embeddings().weight.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.as_tensor(list(p))
        mask[r, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                         do_sample=False, num_beams=1, pad_token_id=pad_id,
                         eos_token_id=list(eos_ids) or None, top_p=None, top_k=None, temperature=None)
    eos = set(int(e) for e in eos_ids)
    conts = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        conts.append(row[:cut])
    return conts


def _response_ids(tokenizer, info, reference: str, eos_ids: Sequence[int]) -> list[int]:
    if tokenizer is None:                       # random models: bytes, as their prompts are
        ids = list(reference.encode("utf-8", "surrogateescape"))
        ids = [i for i in ids if i < info.vocab_size]
    else:
        ids = tokenizer(reference, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids] + ([int(eos_ids[0])] if eos_ids else [])


def _training_prompts(cfg: DataConfig) -> list[Prompt]:
    try:
        prompts = load_prompts(cfg.prompts, languages=cfg.languages, tasks=cfg.tasks)
    except PromptError as e:
        raise TrainError(f"cannot load the training prompts {cfg.prompts!r}: {e}") from e
    if not prompts:
        raise TrainError(f"prompt set {cfg.prompts!r} (languages={cfg.languages}, tasks={cfg.tasks}) is empty — "
                         f"point --prompts at a non-empty training corpus or widen the filters")
    perm = np.random.default_rng(cfg.seed).permutation(len(prompts))      # spread over languages and tasks
    return [prompts[i] for i in perm]


def make_data(cfg: DataConfig) -> Path:
    """Run the target over the training prompts and write the shards (see the module docstring). Returns the
    data folder. Resumable: finished shards are kept; a folder made with other settings is refused."""
    cfg.validate()
    # what needs no model first: the prompts (an unknown set, an empty selection, a missing data root) and the
    # settings of a folder written before
    prompts = _training_prompts(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser() if cfg.out else default_data_dir(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / "manifest.json"
    if mpath.is_file() and read_manifest(out).get("settings") != cfg.key():
        raise TrainError(f"{out} holds training data made with other settings ({mpath}) — pass another --out "
                         f"or delete that folder")
    model, tokenizer, info = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    weight = model.get_output_embeddings().weight
    manifest = {"format": FORMAT, "settings": cfg.key(), "vocab_size": int(weight.shape[0]),
                "hidden_size": int(weight.shape[1]), FINGERPRINT_KEY: head_fingerprint(weight),
                "num_layers": info.num_layers}
    if not mpath.is_file():
        atomic_write(mpath, json.dumps(manifest, indent=1))
    eos = eos_token_ids(model, tokenizer)
    feature_dtype = DTYPES[cfg.feature_dtype]

    # the prompts: encoded, too-long ones skipped, then split into held-out and train, then shards
    chosen: list[tuple[Prompt, list[int]]] = []
    skipped = 0
    for p in prompts:
        if len(chosen) == cfg.num_prompts:
            break
        try:
            ids = encode_prompt(tokenizer, info, p.turns[:1], [], name=p.prompt_id,
                                system_prompt=p.system_prompt if cfg.system_prompt else None)
        except PromptError:
            skipped += 1
            continue
        if len(ids) > cfg.max_prompt_tokens or ("teacher" in cfg.sources and not p.reference):
            skipped += 1
            continue
        chosen.append((p, ids))
    if not chosen:
        raise TrainError(f"no prompt of {cfg.prompts!r} is usable (all longer than max_prompt_tokens="
                         f"{cfg.max_prompt_tokens}, or without a reference response for source 'teacher')")
    held, train = chosen[: cfg.heldout_prompts], chosen[cfg.heldout_prompts:]
    jobs = [(f"heldout-{i // cfg.prompts_per_shard:05d}", held[i:i + cfg.prompts_per_shard])
            for i in range(0, len(held), cfg.prompts_per_shard)]
    jobs += [(f"train-{i // cfg.prompts_per_shard:05d}", train[i:i + cfg.prompts_per_shard])
             for i in range(0, len(train), cfg.prompts_per_shard)]
    todo = [(name, part) for name, part in jobs if not (out / f"{name}.safetensors").is_file()]
    bar = tqdm(total=len(chosen), initial=len(chosen) - sum(len(p) for _, p in todo), unit="prompt",
               desc=f"train data {cfg.model}", disable=not cfg.progress)
    t0, tokens, generated, gen_seconds = time.perf_counter(), 0, 0, 0.0
    for name, part in todo:
        samples: list[Sample] = []
        conts: dict[int, list[int]] = {}
        if "greedy" in cfg.sources:             # batches of similar prompt lengths: little left padding
            t1 = time.perf_counter()
            by_len = sorted(range(len(part)), key=lambda j: len(part[j][1]))
            for a in range(0, len(by_len), cfg.greedy_batch):
                batch = by_len[a:a + cfg.greedy_batch]
                for j, c in zip(batch, greedy_continuations(model, [part[j][1] for j in batch],
                                                             cfg.greedy_new_tokens, eos)):
                    conts[j] = c
            generated += sum(len(c) for c in conts.values())
            gen_seconds += time.perf_counter() - t1
        planned = []                             # (prompt, source, sequence, prompt length), in shard order
        for j, (p, ids) in enumerate(part):
            for source in cfg.sources:
                resp = conts[j] if source == "greedy" else _response_ids(tokenizer, info, p.reference, eos)
                seq = (ids + resp)[: cfg.max_tokens]
                if len(seq) - len(ids) >= 2:
                    planned.append((p, source, seq, len(ids)))
        feats: dict[int, dict] = {}
        if cfg.store_features:
            for group in prefill_groups([len(q[2]) for q in planned], cfg.prefill_tokens):
                for i, f in zip(group, target_features_batch(model, [planned[i][2] for i in group], topk=cfg.topk,
                                                              eagle3=cfg.eagle3_features)):
                    feats[i] = f
                tokens += sum(len(planned[i][2]) for i in group)
                bar.set_postfix(tokens=tokens, tok_per_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        else:
            tokens += sum(len(q[2]) for q in planned)
        for i, (p, source, seq, n_prompt) in enumerate(planned):
            f = feats.pop(i, {})
            mask = torch.zeros(len(seq), dtype=torch.bool)
            mask[n_prompt:] = True
            samples.append(Sample(prompt_id=str(p.prompt_id), source=source,
                                  input_ids=torch.as_tensor(seq, dtype=torch.long), loss_mask=mask,
                                  hidden=f.pop("hidden", None), topk_ids=f.pop("topk_ids", None),
                                  topk_logits=f.pop("topk_logits", None), extra=f))
        bar.update(len(part))
        if samples:
            save_shard(samples, out / f"{name}.safetensors", feature_dtype,
                        {"format": FORMAT, "model": cfg.model, "shard": name})
    bar.close()
    seconds = time.perf_counter() - t0
    n_train, n_held = (len(list(out.glob(f"{s}-*.safetensors"))) for s in ("train", "heldout"))
    print(f"[train data] {out}: {n_train} train + {n_held} held-out shards, {len(chosen)} prompts "
          f"({skipped} skipped as too long or without a reference), sources {','.join(cfg.sources)}")
    print(f"[train data] this run: {tokens:,} tokens in {seconds:.1f} s = {tokens / max(seconds, 1e-9):,.0f} "
          f"tokens/s ({'features stored' if cfg.store_features else 'tokens only'}, "
          f"{next(model.parameters()).dtype}, {torch.get_num_threads()} threads)", flush=True)
    if generated:
        print(f"[train data] of which greedy continuations: {generated:,} tokens generated in {gen_seconds:.1f} s = "
              f"{generated / max(gen_seconds, 1e-9):,.0f} tokens/s (batches of {cfg.greedy_batch})", flush=True)
    return out


def prefill_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped for batched prefills: sorted by length (similar lengths pad little), each
    group as many sequences as fit `count x longest <= budget` tokens (at least one)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups = []
    while order:
        width, take = lengths[order[0]], 1
        while take < len(order) and (take + 1) * max(width, lengths[order[take]]) <= budget:
            width = max(width, lengths[order[take]])
            take += 1
        groups.append(order[:take])
        order = order[take:]
    return groups


def featurizer(manifest: dict, model_name: str, eagle3: bool, loss_on: str = "all"):
    """samples -> samples with features, for a training run on the data folder of `manifest`: as they are where
    the folder stores features, else computed now by the target loaded in the folder's dtype (the features a
    stored folder would hold; with loss_on "response", the top-k at the response's positions only)."""
    if manifest["settings"].get("store_features", True):
        return list
    model = load_model(model_name, dtype=manifest["settings"].get("dtype"))[0]
    topk = manifest["settings"]["topk"]
    return lambda samples: with_features(model, samples, topk=topk, eagle3=eagle3,
                                         response_topk_only=loss_on == "response")


def with_features(model, samples: Sequence[Sample], *, topk: int, eagle3: bool, prefill_tokens: int = 2048,
                  response_topk_only: bool = False) -> list[Sample]:
    """`samples` with the target's features computed now (the prefill `make_data` stores), for a folder that
    stores tokens only; samples that carry features are returned as they are. Features in the target's dtype.
    response_topk_only: the top-k only at the response's positions (a loss on the response reads no other;
    the rest are zeros), which spares the target's LM head on the prompt's rows."""
    todo = [i for i, s in enumerate(samples) if s.hidden is None]
    out = list(samples)
    for group in prefill_groups([samples[todo[g]].input_ids.numel() for g in range(len(todo))], prefill_tokens):
        idx = [todo[g] for g in group]
        at = [samples[i].loss_mask for i in idx] if response_topk_only else None
        for i, f in zip(idx, target_features_batch(model, [samples[i].input_ids.tolist() for i in idx], topk=topk,
                                                   eagle3=eagle3, topk_at=at)):
            s = samples[i]
            out[i] = Sample(prompt_id=s.prompt_id, source=s.source, input_ids=s.input_ids, loss_mask=s.loss_mask,
                            hidden=f.pop("hidden"), topk_ids=f.pop("topk_ids"), topk_logits=f.pop("topk_logits"),
                            extra=f)
    return out


