"""`eagle3`: an EAGLE-3 draft head (Li et al., 2025) - fused low/mid/high target features, its own draft vocabulary.

Architecture (as the official `SafeAILab/EAGLE` `eagle/model/cnets.py` builds it, `Model` + `LlamaDecoderLayeremb`):

    g_i  = [a_i^low ; a_i^mid ; a_i^high]       the target's residual stream ENTERING decoder layers 2, L//2, L-3
                                                 (official modeling_llama_kv.py collects `hidden_states` before
                                                 running layer idx), concatenated in that order: [3 d_t]
    h    = fc(g_i)                               fc: Linear(3 d_t -> d, no bias); skipped for the head's own state
    x    = [input_layernorm(embed(x_{i+1})) ; hidden_norm(h)]                                        [2 d]
    h'   = h + o_proj(attn(q/k/v_proj(x)))       q/k/v take 2d, o_proj gives d; residual = h (before hidden_norm)
    h''  = h' + mlp(post_attention_layernorm(h'))                          the midlayer's output, fed back as h
    logits = lm_head(norm(h''))                  lm_head: Linear(d -> draft_vocab_size), draft ids
    target id = draft id + d2t[draft id];        t2d [V] bool marks the target ids the draft vocabulary holds

Pairs run as in EAGLE-1/2 (`engine.drafters.eagle.EagleTreeDrafter`, whose tree and cache machinery this module
reuses): (g_i, x_{i+1}) at position i over the committed context; in the draft tree a node's h is the head's own
midlayer output at its parent (fc skipped, as the official forward skips fc when the input is already d wide);
after each step the accepted path is re-run with the target's features.

Target features: the harness hands drafters the target's final hidden state only, so the drafter installs a
`FeatureTap` on the target that keeps the residual stream entering the three layers on the latest forward:
forward pre-hooks on the HF decoder layers (backend "hf") and `NativeModel.feature_tap` (backend "native").
The drafter reads it right after the prefill (`begin`) and after each verification (`observe`).

Checkpoints (`cfg.eagle3_head`): a local directory in the official layout - `config.json` (Llama-style, with
`draft_vocab_size`; optional `target_hidden_size` when the head is narrower than the target) and
`model.safetensors` or `pytorch_model.bin` (read with weights_only=True) holding `fc.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`,
`d2t` (int64 [draft_vocab_size]), `t2d` (bool [vocab_size]) and optionally `embed_tokens.weight` (else the
target's input embedding, as the official loader does); or a hub id (downloaded with huggingface_hub, a
clear error offline). Official heads whose draft vocabulary is the whole vocabulary omit d2t / t2d (identity).
`"random"` builds an untrained head shaped after the target over the whole vocabulary (tests, calibration).

Vocabulary policies work inside the draft vocabulary: a policy's candidates are target ids and only those t2d
admits can be drafted. `full` = the whole draft vocabulary; `frspec` = the top-K of the frequency list that t2d
admits (stats: `frspec_candidates`, `frspec_admitted`); `microspec` = MicroSpec's window over target ids,
unchanged, scoring the entries t2d admits (stats: `window_vocab`, the window's distinct tokens, and
`window_admitted`, those t2d admits, both means over steps); `oracle` = the whole draft vocabulary's proposals
at the cost of a [w_max, d] head; `dynaspec` = DynaSpec's clusters over the draft vocabulary (the rows of the
head's own lm_head, fitted for this head and depth: `python -m specvocab.engine.jobs.fit_dynaspec --drafter eagle3`), the
router reading [h; E(x)] with E(x) the target's LM-head row of the target id x, the union head over draft rows
and its slots mapped through d2t (stats as for eagle's dynaspec, sizes in draft rows).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specvocab.engine.catalog import shipped_eagle3_heads
from specvocab.engine.drafters import register_drafter
from specvocab.engine.drafters.eagle import (EagleTreeDrafter, check_head_target, head_digest, llama_config, random_eagle_head,
                                   read_state_dict, resolve_head_dir)
from specvocab.engine.drafters.layerskip import text_config
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.methods import SAMPLING, TARGET, TREE, MethodSpec, eagle_candidates
from specvocab.engine.target import cache_kwarg, decoder, native_model, resolve_backend
from specvocab.engine.vocab import DynaSpecVocab, FrSpecVocab, MicroSpecVocab, OracleVocab, VocabError, VocabPolicy
from specvocab.engine.vocab.dynaspec import drafter_key as dynaspec_drafter_key
from specvocab.kernels import cpu as cpu_kernels
from specvocab.kernels.head import packed_head
from specvocab.kernels.streams import PackedLMHead
from specvocab.kernels.window import GatherList

# the method's description (engine.methods: read from this source without importing it); its drafter: Eagle3Drafter.
# Uncalibrated g: 59 = EAGLE-2's 60 draft tokens (MicroSpec §4.1, FR-Spec §4.1) minus the root; cap: EAGLE-2's
# candidates at the config's depth and top-k.
METHOD = MethodSpec("eagle3", order=80, lm_head=True, default_draft_size=59, max_draft_size=eagle_candidates,
                    calibration_fields=(*SAMPLING, *TARGET, *TREE, "eagle3_head", "vocab"))

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"      # `architectures` of the released heads' config.json


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The decoder layers whose INPUT (the residual stream entering them) an EAGLE-3 head reads: low, middle,
    high = 2, L//2, L-3 as the official target forward picks them, clamped into [0, L-1] for tiny targets."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


# --- the target's features -----------------------------------------------------------------------------------

class FeatureTap:
    """Keeps the residual stream entering some decoder layers of a target on its latest forward.

    HF backend: forward pre-hooks on those layers (removed when the tap is garbage-collected). Native backend:
    `NativeModel.feature_tap` (this object is callable as `tap(layer index, x)`). `take(n)` returns the first n
    rows of the three layers' inputs concatenated ([n, 3 d], low / mid / high) and forgets them, so a read
    never sees a stale forward."""

    def __init__(self, model, layers: tuple[int, ...], backend: str = "auto"):
        self.layers = tuple(layers)
        self.latest: dict[int, torch.Tensor] = {}
        self.native = None
        blocks = decoder(model).layers
        handles = [blocks[i].register_forward_pre_hook(self._hf_hook(i), with_kwargs=True)
                   for i in sorted(set(self.layers))]
        weakref.finalize(self, _remove_all, handles)
        if resolve_backend(model, backend) == "native":
            self.native = native_model(model)
            self.native.feature_tap = self

    def _hf_hook(self, index: int):
        latest = self.latest                    # the dict only: the hook must not keep the tap alive

        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            latest[index] = x[0] if x.dim() == 3 else x                 # [n, d] (batch 1)
        return hook

    def __call__(self, index: int, x: torch.Tensor) -> None:
        if index in self.layers:
            self.latest[index] = x

    def take(self, n: int) -> torch.Tensor:
        missing = [i for i in self.layers if i not in self.latest]
        if missing:
            raise DrafterError(f"eagle3 has no target features for decoder layers {missing} from the target's last "
                               f"forward: the target ran outside the feature tap (its native forward was rebuilt, "
                               f"or another backend ran it) — build the drafter for the model and backend that "
                               f"decode, through engine.harness.generate")
        feats = [self.latest[i] for i in self.layers]
        if any(f.shape[0] < n for f in feats):
            raise DrafterError(f"eagle3 expected target features for {n} rows but the target's last forward ran "
                               f"{min(f.shape[0] for f in feats)} — propose() and observe() must follow the "
                               f"target's forward of the same tree")
        self.latest.clear()
        return torch.cat([f[:n] for f in feats], dim=-1)


def _remove_all(handles) -> None:
    for h in handles:
        h.remove()


# --- the head --------------------------------------------------------------------------------------------------

class Eagle3Layer(nn.Module):
    """The midlayer: attention over [input_layernorm(embedding); hidden_norm(h)] (2d wide), residual h."""

    def __init__(self, config, *, attention_bias: bool = False):
        super().__init__()
        d = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * d, old.out_features, bias=attention_bias))
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def attention_input(self, emb, h):
        """[.., 2 d]: what the attention reads, [input_layernorm(embedding); hidden_norm(h)]."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)

    def forward(self, emb, h, position_embeddings, attention_mask, cache=None, cache_kw="cache"):
        """emb, h [1, q, d] -> [1, q, d]."""
        x = self.attention_input(emb, h)
        a = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                           **({cache_kw: cache} if cache is not None else {}))[0]
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft network; state-dict keys are the official checkpoints' (module docstring)."""

    def __init__(self, config, *, draft_vocab_size: int, target_hidden_size: int | None = None,
                 with_embedding: bool = False, attention_bias: bool = False, fc_bias: bool = False):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.target_hidden_size = target_hidden_size or d
        self.fc = nn.Linear(3 * self.target_hidden_size, d, bias=fc_bias)
        self.midlayer = Eagle3Layer(config, attention_bias=attention_bias)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if with_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, source: str = "the EAGLE-3 head") -> None:
    """Raise unless d2t [K] and t2d [V] describe one draft vocabulary: every i + d2t[i] inside [0, V), distinct,
    and t2d exactly the set {i + d2t[i]}."""
    target = torch.arange(d2t.numel(), device=d2t.device) + d2t.long()
    V = t2d.numel()
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= V):
        bad = target[(target < 0) | (target >= V)][:5].tolist()
        raise DrafterError(f"{source}: d2t maps draft ids to target ids {bad} outside the vocabulary [0, {V}) — the "
                           f"head was made for another tokenizer or its d2t is corrupt")
    marked = torch.zeros(V, dtype=torch.bool, device=t2d.device)
    marked[target.to(t2d.device)] = True
    if int(marked.sum()) != d2t.numel() or not torch.equal(marked, t2d.bool()):
        raise DrafterError(f"{source}: d2t and t2d disagree - t2d must be exactly the set {{i + d2t[i]}} "
                           f"({d2t.numel()} draft ids name {int(marked.sum())} distinct target ids, t2d marks "
                           f"{int(t2d.sum())}, {int((marked != t2d.bool()).sum())} ids differ) — export both maps "
                           f"from one token list (engine.frequency.eagle3_maps)")


def load_eagle3_head(source: str) -> Eagle3Head:
    """An EAGLE-3 head from a local directory in the official layout or a hub id (module docstring)."""
    path = resolve_head_dir(source, field="eagle3_head", layout="EAGLE-3", shipped=shipped_eagle3_heads())
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise DrafterError(f"{path} has no config.json — an EAGLE-3 checkpoint directory needs one")
    values = json.loads(cfg_file.read_text())
    if values.get("num_hidden_layers", 1) != 1:
        raise DrafterError(f"{source}: config.json has num_hidden_layers={values['num_hidden_layers']} — this "
                           f"loader reads one-layer EAGLE-3 heads (one midlayer)")
    state = {k.removeprefix("model."): v for k, v in read_state_dict(path, layout="EAGLE-3").items()}
    if not any(k.startswith("midlayer.") for k in state):
        hint = " (it has layers.0.* keys: an EAGLE-1/2 head, use method='eagle')" if any(
            k.startswith("layers.0.") for k in state) else ""
        raise DrafterError(f"{source} is not an EAGLE-3 checkpoint: no midlayer.* tensors{hint}")
    vocab = values.get("vocab_size")
    draft_vocab = int(values.get("draft_vocab_size") or vocab or 0)
    lm_rows = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else None
    if lm_rows is not None and lm_rows != draft_vocab:
        raise DrafterError(f"{source}: config.json says draft_vocab_size={draft_vocab} but lm_head.weight has "
                           f"{lm_rows} rows — the config and the weights come from different heads")
    if "d2t" not in state and "t2d" not in state and vocab is not None and draft_vocab == vocab:
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)            # the whole vocabulary: identity maps
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    for name, size, what in (("d2t", draft_vocab, "draft_vocab_size"), ("t2d", vocab, "vocab_size")):
        if name not in state:
            raise DrafterError(f"{source} holds no {name} tensor — an EAGLE-3 head over a draft vocabulary of "
                               f"{draft_vocab} < {vocab} ids needs d2t and t2d")
        if state[name].numel() != size:
            raise DrafterError(f"{source}: {name} has {state[name].numel()} entries but config.json's {what} is "
                               f"{size}")
    check_maps(state["d2t"].long(), state["t2d"].bool(), source)
    head = Eagle3Head(llama_config(values), draft_vocab_size=draft_vocab,
                      target_hidden_size=values.get("target_hidden_size"),
                      with_embedding="embed_tokens.weight" in state,
                      attention_bias="midlayer.self_attn.q_proj.bias" in state, fc_bias="fc.bias" in state)
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    try:
        result = head.load_state_dict(state, strict=False)
    except RuntimeError as e:                                   # a tensor of the wrong shape
        raise DrafterError(f"{source} does not match its config.json: {e}") from None
    if result.missing_keys or result.unexpected_keys:
        raise DrafterError(f"{source} does not match the EAGLE-3 layout: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    head.feature_layers = values.get("eagle_aux_hidden_state_layer_ids") or (
        values.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    head.target_block = values.get("specvocab")          # a head trained here names its target (engine.artifacts)
    return head


def random_eagle3_head(target, seed: int = 0) -> Eagle3Head:
    """An untrained head shaped after the target, over the whole vocabulary (identity maps)."""
    like = random_eagle_head(target, seed)                        # its Llama config, shaped after the target
    V = like.config.vocab_size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = Eagle3Head(like.config, draft_vocab_size=V)
        for name, p in head.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
    head.t2d.fill_(True)
    return head


# --- vocabulary policies inside the draft vocabulary -------------------------------------------------------------

@dataclass
class DraftVocab:
    """The draft vocabulary's maps on the drafter's device."""

    d2t: torch.Tensor              # [K] int64: target id = draft id + d2t[draft id]
    t2d: torch.Tensor              # [V] bool: the target ids the draft vocabulary holds
    draft_to_target: torch.Tensor  # [K] int64 target id of each draft id
    row_of_target: torch.Tensor    # [V] int64 draft id of each target id, -1 outside

    @classmethod
    def of(cls, head: Eagle3Head, device) -> "DraftVocab":
        d2t, t2d = head.d2t.to(device).long(), head.t2d.to(device).bool()
        to_target = torch.arange(d2t.numel(), device=device) + d2t
        row = torch.full((t2d.numel(),), -1, dtype=torch.long, device=device)
        row[to_target] = torch.arange(d2t.numel(), device=device)
        return cls(d2t, t2d, to_target, row)

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()


def _target_view(lm_head: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A [V, d] stand-in for a target-indexed head that allocates one row: the policies' constructors read
    its shape (the target's vocabulary) and dtype; the rows they score come from the draft head."""
    return lm_head.new_zeros(1, lm_head.shape[1]).expand(vocab_size, -1)


class DraftFullVocab(VocabPolicy):
    """`full`: the whole draft vocabulary, slot i = draft id i = target id i + d2t[i]."""

    name = "full"

    def __init__(self, lm_head, cfg, maps: DraftVocab, *, timer=None):
        super().__init__(lm_head, cfg, timer=timer)
        self.maps = maps
        self.vocab_size = maps.vocab_size

    def logits(self, h):
        h = self._check_h(h)
        return torch.nn.functional.linear(h, self.weight).float(), self.maps.draft_to_target

    def active_size(self):
        return self.weight.shape[0]

    def active_mask(self):
        return self.maps.t2d


class DraftFrSpecVocab(FrSpecVocab):
    """`frspec`: the top-K target ids of the frequency list, of which those t2d admits are scored."""

    def __init__(self, lm_head, cfg, maps: DraftVocab, *, timer=None):
        super().__init__(_target_view(lm_head, maps.vocab_size), cfg, timer=timer)
        self.maps = maps
        self.candidates = self.k
        self.ids = self.ids[maps.t2d[self.ids]]                 # target ids, most frequent first
        self.k = int(self.ids.numel())
        if self.k == 0:
            raise VocabError(f"none of the frequency list's top {self.candidates} ids is in the EAGLE-3 head's draft "
                             f"vocabulary ({maps.d2t.numel()} ids) — raise frspec_k or use a list counted with the "
                             f"target's tokenizer")
        self.packed = lm_head[maps.row_of_target[self.ids]].contiguous()     # [K', d]
        self.mask &= maps.t2d

    def stats(self):
        return {**super().stats(), "frspec_candidates": float(self.candidates), "frspec_admitted": float(self.k)}


class _DraftPackedHead(PackedLMHead):
    """MicroSpec's packed head with its window over target ids and rows from the draft head: an entering
    token's row is lm_head[row_of_target[token]]; tokens outside the draft vocabulary are never gathered and
    their slots score -inf."""

    def __init__(self, lm_head, maps: DraftVocab, w_max: int, mode: str):
        super().__init__(_target_view(lm_head, maps.vocab_size), w_max, mode=mode)
        self.weight = lm_head                                   # [K, d] rows by draft id
        self.maps = maps

    def _gather(self, todo):
        tok = todo.tokens
        rows = torch.where(tok >= 0, self.maps.row_of_target[tok.clamp(min=0).long()], torch.full_like(tok, -1))
        super()._gather(GatherList(todo.slots, rows, todo.count))   # -1 rows are skipped

    def admitted_slots(self) -> torch.Tensor:
        """[w_max] the window's target id per slot where t2d admits it, else -1."""
        tok = self.state.tok_of_slot
        ok = (tok >= 0) & self.maps.t2d[tok.clamp(min=0).long()]
        return torch.where(ok, tok, torch.full_like(tok, -1))

    def logits(self, h):
        self.wait_gather()
        return packed_head(h.to(self.dtype), self.packed, self.admitted_slots())


class DraftMicroSpecVocab(MicroSpecVocab):
    """`microspec`: the window holds target ids exactly as for a full-vocabulary drafter; the head scores the
    window entries t2d admits. stats: `window_vocab` / `window_admitted` (means over steps)."""

    def __init__(self, lm_head, cfg, maps: DraftVocab, *, timer=None):
        super().__init__(_target_view(lm_head, maps.vocab_size), cfg, timer=timer)
        self.maps = maps
        self.head = _DraftPackedHead(lm_head, maps, cfg.w_max, cfg.window_mode)
        self._window: list[torch.Tensor] = []

    def begin_ids(self, prompt_ids, prefill_topk):
        self._window = []
        super().begin_ids(prompt_ids, prefill_topk)

    def active_mask(self):
        return self.head.state.active & self.maps.t2d

    def active_size(self):
        return self.active_mask().sum()

    def record_step(self):
        super().record_step()
        self._window.append(self.head.active_size())

    def stats(self):
        out = super().stats()
        if self._window:
            out["window_vocab"] = float(torch.stack([w.to("cpu", torch.float64) for w in self._window]).mean())
            out["window_admitted"] = out["mean_active_vocab"]
        return out


class DraftOracleVocab(OracleVocab):
    """`oracle`: the whole draft vocabulary's proposals; charged: a dense [w_max, d] head of draft rows."""

    def __init__(self, lm_head, cfg, maps: DraftVocab, *, timer=None):
        super().__init__(_target_view(lm_head, maps.vocab_size), cfg, timer=timer)
        self.maps = maps
        self.draft_head = lm_head
        self.tiny = lm_head[torch.arange(self.w_max, device=lm_head.device) % lm_head.shape[0]].contiguous()

    def logits(self, h):
        h = self._check_h(h)
        return torch.nn.functional.linear(h, self.draft_head).float(), self.maps.draft_to_target

    def active_mask(self):
        return self.maps.t2d


class DraftDynaSpecVocab(DynaSpecVocab):
    """`dynaspec` inside the draft vocabulary (DynaSpec §4.2-4.3): the clusters partition the draft head's rows
    (draft ids), fitted for this head and depth (`engine.vocab.dynaspec.drafter_key`: the head's hash); the router
    reads E(x) from `embed` [V, d] by target id (the tree's tokens are target ids); the union head's slots are
    mapped to target ids through d2t. Sizes (`mean_active_vocab`, `mean_row_vocab`, `mean_union_vocab`) count
    draft rows."""

    def __init__(self, lm_head, cfg, maps: DraftVocab, *, embed: torch.Tensor, drafter_key: dict, timer=None):
        super().__init__(lm_head, cfg, timer=timer, drafter_key=drafter_key, embed=embed)
        self.maps = maps
        self.vocab_size = maps.vocab_size

    def logits(self, h):
        logits, idx = super().logits(h)
        return logits, self.maps.draft_to_target[idx]

    def active_mask(self):
        mask = torch.zeros(self.maps.vocab_size, dtype=torch.bool, device=self.maps.t2d.device)
        mask[self.maps.draft_to_target] = self.head.step_mask                 # no sync: a scatter of [K] bools
        return mask


_DRAFT_POLICIES = {"full": DraftFullVocab, "frspec": DraftFrSpecVocab, "microspec": DraftMicroSpecVocab,
                   "oracle": DraftOracleVocab, "dynaspec": DraftDynaSpecVocab}


def make_eagle3_policy(cfg, lm_head: torch.Tensor, maps: DraftVocab, *, timer=None, embed: torch.Tensor | None = None,
                       drafter_key: dict | None = None) -> VocabPolicy:
    """The policy `cfg.vocab` inside an EAGLE-3 head's draft vocabulary (module docstring). dynaspec needs `embed`
    (the target's LM-head rows, E(x) by target id) and the drafter's `drafter_key`."""
    if cfg.vocab not in _DRAFT_POLICIES:
        raise VocabError(f"unknown vocab policy {cfg.vocab!r} for eagle3 — choose one of {list(_DRAFT_POLICIES)}")
    if cfg.vocab == "dynaspec":
        return DraftDynaSpecVocab(lm_head, cfg, maps, embed=embed, drafter_key=drafter_key, timer=timer)
    return _DRAFT_POLICIES[cfg.vocab](lm_head, cfg, maps, timer=timer)


# --- the drafter -------------------------------------------------------------------------------------------------

@register_drafter("eagle3")
class Eagle3Drafter(EagleTreeDrafter):
    name = "eagle3"

    def __init__(self, target, cfg, head: Eagle3Head | None = None):
        super().__init__(target, cfg)
        cfg.require_draft_size()
        self.head_source = "(passed in)" if head is not None else cfg.eagle3_head
        if head is None:
            source = cfg.eagle3_head                 # resolved with the run (a shipped head for None), never here
            if source is None:
                raise DrafterError("method 'eagle3' needs an EAGLE-3 draft head and no EAGLE-3 head ships for this "
                                   "model (or the config was not resolved: engine.resolve.resolve_run, "
                                   "engine.harness.resolve_config): pass eagle3_head=<local directory of an official EAGLE-3 checkpoint "
                                   "(config.json + model.safetensors or pytorch_model.bin) or its hub id>, train one "
                                   "(`python -m specvocab.engine.jobs.train_eagle3 --model <name>`), or eagle3_head='random' "
                                   "for an untrained head (tests)")
            head = random_eagle3_head(target, cfg.seed) if source == "random" else load_eagle3_head(source)
        # a head trained here carries its target's LM-head fingerprint: a same-shape head of another target (or a
        # fine-tune of it) is refused; an official checkpoint has no block and is checked by its shapes below
        check_head_target(self.head_source, getattr(head, "target_block", None), target, field="eagle3_head",
                          retrain="`python -m specvocab.engine.jobs.train_eagle3 --model <name>`")
        t = text_config(target)
        V = target.get_output_embeddings().weight.shape[0]
        if head.target_hidden_size != t.hidden_size:
            raise DrafterError(f"the EAGLE-3 head reads target features of width {head.target_hidden_size} (fc takes "
                               f"3 x {head.target_hidden_size}) but the target's hidden size is {t.hidden_size} — use "
                               f"the EAGLE-3 checkpoint trained for this target")
        if head.config.vocab_size != V or head.t2d.numel() != V:
            raise DrafterError(f"the EAGLE-3 head's vocabulary ({head.config.vocab_size}) differs from the target's "
                               f"({V}) — use the EAGLE-3 checkpoint trained for this target")
        check_maps(head.d2t, head.t2d, f"eagle3_head={self.head_source!r}")
        embed = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()
        if embed.weight.shape[1] != head.hidden_size:
            raise DrafterError(f"the EAGLE-3 head has hidden size {head.hidden_size} and no embed_tokens.weight of its "
                               f"own, but the target's embedding is {embed.weight.shape[1]} wide — the checkpoint must "
                               f"carry its embedding")
        dtype = target.get_output_embeddings().weight.dtype
        self.head_sha = head_digest(head)                              # before the cast: the file's weights
        self.eagle = head.to(device=self.device, dtype=dtype).eval()     # d2t / t2d stay int64 / bool
        if cfg.cpu_kernels:                                            # bf16 / fp32 on a CPU: kernels.cpu's linear
            cpu_kernels.route_linears(self.eagle)
        self._fuse(self.eagle.midlayer)                                # ... and the midlayer as one call
        self.embed = embed
        self.cache_kw = cache_kwarg(self.eagle.midlayer.self_attn)
        self.maps = DraftVocab.of(self.eagle, self.device)
        self.head_weight = self.eagle.lm_head.weight                   # [K, d] draft ids
        self.feature_dtype = dtype
        self.softcap = None                                            # the draft head has no soft-capping
        L = t.num_hidden_layers
        layers = getattr(head, "feature_layers", None) or eagle3_feature_layers(L)
        if len(layers) != 3 or not all(0 <= int(i) < L for i in layers):
            raise DrafterError(f"the EAGLE-3 head reads target layers {list(layers)} — the target has {L} decoder "
                               f"layers and an EAGLE-3 head reads three of them")
        self.feature_layers = tuple(int(i) for i in layers)
        self.tap = FeatureTap(target, self.feature_layers, cfg.backend)
        self._make_policy()
        self._reset_backbone()

    def _make_policy(self):
        self.policy = make_eagle3_policy(self.cfg, self.head_weight, self.maps, timer=self.timer,
                                         embed=self.router_embedding(), drafter_key=self.drafter_key())

    def router_embedding(self) -> torch.Tensor:
        """[V, d] the rows E(x) DynaSpec's router reads by target id: the target's LM head, as for eagle."""
        return self.target.get_output_embeddings().weight.detach()

    def drafter_key(self) -> dict:
        return dynaspec_drafter_key(self.cfg, head_sha=self.head_sha)

    def _head_topk(self, h, k):
        return self.policy.head_topk(self.eagle.norm(h), k)           # lm_head(norm(h)); ids mapped through d2t

    def _run(self, tokens, feats, positions, visible, own=False):
        """Pairs (feats, tokens [q]) at positions [q]; feats = target features [q, 3 d_t] (through fc) or the
        head's own midlayer outputs [q, d] (own); visible [q, length + q] -> the midlayer's output [q, d]."""
        h = feats if own else self.eagle.fc(feats.to(self.feature_dtype))              # [q, d]
        emb = self.embed(tokens).to(h.dtype)
        mid = self.eagle.midlayer
        if self.fused is not None:                   # kernels.cpu.layer: the attention input given, residual h
            return self._backbone(None, h, positions, visible, own, attn_in=mid.attention_input(emb, h))

        def layer(h, pe, mask):
            return mid(emb[None], h, pe, mask, self.cache, self.cache_kw)
        return self._backbone(layer, h, positions, visible, own)

    def _prompt_features(self, prompt_ids, prefill_hidden):
        return self.tap.take(prompt_ids.numel())

    def _step_features(self, step):
        return self.tap.take(step.tree.size)

    def stats(self):
        return {**super().stats(), "draft_vocab": float(self.maps.d2t.numel())}
