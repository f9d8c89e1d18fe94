"""EAGLE heads that travel: the exported layout is right for EAGLE's and SGLang's code, not only ours.

- Gemma's `get_input_embeddings()` scales by sqrt(d); a head trained here learned on those embeddings. The
  exported fc has the scale folded into its token half, so a plain `nn.Embedding` lookup - the way EAGLE's
  cnets1.py embeds - gives the same fc output as the package's own path; loading divides it out again: the
  shipped Gemma head loads back to the trained fp16 head bit for bit (a digest of its tensors) and drafts
  what that head drafts in the unfolded layout (both computed on this machine);
- an official-layout head (embed scale 1) is drafted with the raw table on a Gemma target, as EAGLE would;
- `save_eagle_head(..., embed_tokens=...)` writes `embed_tokens.weight`, so a strict load of the official
  key set succeeds; config.json and the weights are one pair (a torn save is refused);
- the head digest names a head's weights: a retrained head in the same folder gets another one.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specvocab.engine.drafters.eagle import (EagleDrafter, EagleHead, llama_config, embed_scale, head_digest,
                                   load_eagle_head, random_eagle_head, save_eagle_head)
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model
from specvocab.engine.shipped import SHIPPED_HEADS


def _in_package_fc(head: EagleHead, target, tokens, feats):
    """fc's output the way the package drafts (EagleDrafter._run)."""
    emb = EagleDrafter._embedding(target, head)
    return head.fc(torch.cat([emb(tokens).to(feats.dtype), feats], dim=-1))


def _eagle_reference_fc(folder: Path, table: torch.Tensor, tokens, feats):
    """fc's output as EAGLE's cnets1.py computes it from the exported files: a plain nn.Embedding over the
    target's raw table (no scale), then fc over cat((inputs_embeds, hidden_states), dim=-1)."""
    state = load_file(str(folder / "model.safetensors"))
    emb = nn.Embedding(*table.shape)
    emb.weight.data.copy_(state.get("embed_tokens.weight", table))
    fc = nn.Linear(2 * table.shape[1], table.shape[1], bias="fc.bias" in state)
    fc.load_state_dict({k[3:]: v.float() for k, v in state.items() if k.startswith("fc.")})
    return fc(torch.cat([emb(tokens).float(), feats], dim=-1))


def test_the_exported_gemma_head_is_right_for_a_plain_embedding(tmp_path):
    model, _, _ = load_model("random-gemma3", seed=0)
    assert embed_scale(model) == pytest.approx(model.config.hidden_size ** 0.5)      # Gemma scales by sqrt(d)
    head = random_eagle_head(model, seed=1)
    assert head.embed_scale == embed_scale(model)
    tokens = torch.tensor([3, 17, 250, 9])
    feats = 0.05 * torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.set_grad_enabled(False)
    want = _in_package_fc(head, model, tokens, feats)
    table = model.get_input_embeddings().weight.detach()
    for dtype in (torch.float32, torch.float16):
        out = save_eagle_head(head, tmp_path / str(dtype), target_name="random-gemma3",
                              target_weight=model.get_output_embeddings().weight, dtype=dtype)
        ref = _eagle_reference_fc(out, table, tokens, feats)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(ref, want, rtol=tol, atol=tol * float(want.abs().max()))
        # without the fold (the unexported layout) a raw lookup is far off: the check above has teeth
        naive = head.fc(torch.cat([table[tokens], feats], dim=-1))
        assert float((naive - want).abs().max()) > 0.3 * float(want.abs().max())
        # loading divides the scale out again: the package's path is what it was
        back = load_eagle_head(str(out))
        assert back.embed_scale == head.embed_scale
        torch.testing.assert_close(_in_package_fc(back, model, tokens, feats), want, rtol=tol, atol=tol)
        if dtype == torch.float16:       # the unfolded fc is the fp16 head exactly, as an unfolded save would be
            assert torch.equal(back.fc.weight, head.fc.weight.half().float())
    torch.set_grad_enabled(True)


def test_an_official_head_is_drafted_with_the_raw_table_on_gemma():
    model, _, _ = load_model("random-gemma3", seed=0)
    head = random_eagle_head(model)
    head.embed_scale = 1.0                              # what load_eagle_head gives an official checkpoint
    tokens = torch.tensor([5, 6])
    emb = EagleDrafter._embedding(model, head)
    assert torch.equal(emb(tokens), model.get_input_embeddings().weight[tokens])
    head.embed_scale = 2.0                              # a head trained on another scale than this target's
    with pytest.raises(DrafterError, match="scaled by 2"):
        EagleDrafter._embedding(model, head)


def test_embed_tokens_is_written_on_request_and_a_strict_load_succeeds(tmp_path):
    model, _, _ = load_model("random-llama", seed=0)
    head = random_eagle_head(model)
    table = model.get_input_embeddings().weight
    out = save_eagle_head(head, tmp_path / "h", target_name="random-llama",
                          target_weight=model.get_output_embeddings().weight, embed_tokens=table)
    state = load_file(str(out / "model.safetensors"))
    assert torch.equal(state["embed_tokens.weight"], table.detach())
    strict = EagleHead(llama_config(json.loads((out / "config.json").read_text())), with_embedding=True)
    strict.load_state_dict(state, strict=True)         # EAGLE before March 2025: strict=True, embed_tokens expected
    back = load_eagle_head(str(out))
    assert back.embed_tokens is not None and head_digest(back) == head_digest(head)
    plain = save_eagle_head(head, tmp_path / "p", target_name="random-llama",
                            target_weight=model.get_output_embeddings().weight)
    assert "embed_tokens.weight" not in load_file(str(plain / "model.safetensors"))


def test_config_and_weights_are_one_pair(tmp_path, monkeypatch):
    import specvocab.engine.drafters.eagle as eagle_mod
    model, _, _ = load_model("random-llama", seed=0)
    weight = model.get_output_embeddings().weight
    out = save_eagle_head(random_eagle_head(model, seed=0), tmp_path / "h", target_name="random-llama",
                          target_weight=weight)
    ids = json.loads((out / "config.json").read_text())["specvocab"]["weights_id"]
    load_eagle_head(str(out))

    def dies(*a, **k):
        raise KeyboardInterrupt("killed between the two files")
    monkeypatch.setattr(eagle_mod, "atomic_write", dies)
    with pytest.raises(KeyboardInterrupt):
        save_eagle_head(random_eagle_head(model, seed=1), out, target_name="random-llama", target_weight=weight)
    assert json.loads((out / "config.json").read_text())["specvocab"]["weights_id"] == ids      # the old config
    with pytest.raises(DrafterError, match="different saves"):
        load_eagle_head(str(out))


def test_the_head_digest_tells_a_retrained_head_apart():
    model, _, _ = load_model("random-llama", seed=0)
    a, b = random_eagle_head(model, seed=0), random_eagle_head(model, seed=0)
    assert head_digest(a) == head_digest(b)
    with torch.no_grad():
        b.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert head_digest(a) != head_digest(b)


def test_the_shipped_gemma_head_is_exported_with_the_scale_folded():
    cfg = json.loads((SHIPPED_HEADS / "gemma-3-270m" / "config.json").read_text())
    assert cfg["specvocab"]["embed_scale_folded"] == pytest.approx(640 ** 0.5)
    head = load_eagle_head("specvocab:gemma-3-270m")
    assert head.embed_scale == pytest.approx(640 ** 0.5)
    state = load_file(str(SHIPPED_HEADS / "gemma-3-270m" / "model.safetensors"))
    torch.testing.assert_close(state["fc.weight"][:, :640] / head.embed_scale, head.fc.weight[:, :640])
    smol = json.loads((SHIPPED_HEADS / "smollm2-135m-instruct" / "config.json").read_text())
    assert "embed_scale_folded" not in smol["specvocab"]                  # SmolLM2 does not scale


# sha256 over the Gemma head as it was trained and shipped (fp16, fc unfolded): each tensor's name, then its
# bytes, names sorted (`_digest`). Data, not arithmetic: the same on every machine.
TRAINED_GEMMA_HEAD = "30fe6b544eec108019c78ea7bffdeea4e073faf2ea9a34f35c47f16dc73b276c"


def _digest(head: EagleHead, dtype: torch.dtype = torch.float16) -> str:
    """sha256 of a head's tensors in `dtype` (name, then bytes; names sorted; rotary tables left out)."""
    m = hashlib.sha256()
    state = head.state_dict()
    for k in sorted(k for k in state if not k.startswith("rotary_emb.")):
        m.update(k.encode())
        m.update(state[k].detach().to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
    return m.hexdigest()


def test_the_exported_gemma_head_loads_back_to_the_trained_weights_bit_for_bit(tmp_path):
    """The shipped Gemma head (fc folded on disk in fp32, unfolded on load) is the trained fp16 head exactly -
    every tensor, so every draft it makes on any machine - and an export of it loads back to the same bits.
    Mutants checked: the load dividing without rounding back to the stored dtype, or not dividing; an export
    that folds in fp16 (each fails the digest)."""
    head = load_eagle_head("specvocab:gemma-3-270m")
    assert head.stored_dtype == "float16" and _digest(head) == TRAINED_GEMMA_HEAD
    assert torch.equal(head.fc.weight, head.fc.weight.half().float())     # fp16 values, not near them
    model, _, _ = load_model("random-gemma3", seed=0)        # the target only names itself in the config
    again = save_eagle_head(head, tmp_path / "again", target_name="gemma-3-270m",
                            target_weight=model.get_output_embeddings().weight, dtype=torch.float16)
    assert load_file(str(again / "model.safetensors"))["fc.weight"].dtype == torch.float32       # folded, fp32
    assert _digest(load_eagle_head(str(again))) == TRAINED_GEMMA_HEAD


def _unfolded_layout(head: EagleHead, folder: Path) -> Path:
    """`head` written in the layout it was trained and first shipped in: fp16 tensors, fc unfolded, a
    `specvocab` block without `weights_id` or `embed_scale_folded` (the loader then takes the target's scale)."""
    folder.mkdir()
    config = json.loads((SHIPPED_HEADS / "gemma-3-270m" / "config.json").read_text())
    config["torch_dtype"] = "float16"
    for key in ("weights_id", "embed_scale_folded"):
        config["specvocab"].pop(key)
    state = {k: v.detach().half().contiguous() for k, v in head.state_dict().items()
             if not k.startswith("rotary_emb.")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_exported_gemma_head_drafts_what_the_unfolded_head_drafts(dtype, tmp_path):
    """The shipped Gemma head in its exported layout (fc folded, scale recorded) and the same weights in the
    unfolded layout (scale taken from the target) draft the same trees and output, both computed here. With
    the digest test above (the exported head is the trained one bit for bit), the shipped head drafts what the
    trained head drafts. Mutant checked: the unfolded layout's head embedded with the raw table (embed_scale
    None read as 1) changes the trees. (A load that leaves the scale in fc fails the digest test.)"""
    from specvocab.engine.prompts import encode_prompt, load_prompts
    model, tok, info = load_model("gemma-3-270m", dtype=dtype)
    shipped = load_eagle_head("specvocab:gemma-3-270m")
    old = _unfolded_layout(shipped, tmp_path / "unfolded")
    assert load_eagle_head(str(old)).embed_scale is None and shipped.embed_scale == embed_scale(model)
    p = load_prompts("spec_bench", categories=["summarization"], per_category=1)[0]
    ids = torch.as_tensor(encode_prompt(tok, info, p.turns[:1], [], max_new_tokens=16))
    runs = [generate(model, ids, method="eagle", max_new_tokens=8, tokenizer=tok, info=info, record=True,
                     draft_size=59, eagle_head=source) for source in ("specvocab:gemma-3-270m", str(old))]
    assert runs[0].output_ids.tolist() == runs[1].output_ids.tolist()
    assert [[r.tree_tokens, r.tree_parents] for r in runs[0].records] == \
        [[r.tree_tokens, r.tree_parents] for r in runs[1].records]
    assert max(len(r.tree_tokens) for r in runs[0].records) > 32 and runs[0].tau > 1        # trees that hit


def test_the_recipe_is_stated_as_eagles_code_has_it():
    """EAGLE's eagle/train/main.py clips by value (clip_grad_value_), scales its uniform noise by 512 /
    sequence length, and trains the head from scratch: the module, its config comments and the model cards
    say so (not: clips by norm, noise of a fixed scale, a fine-tuned head)."""
    import inspect
    import specvocab.engine.train.eagle2 as tr
    assert "clip_grad_value_" in tr.__doc__ and "512 / L" in tr.__doc__ and "from scratch" in tr.__doc__
    source = inspect.getsource(tr.TrainConfig)
    assert "fine-tunes" not in source and "EAGLE clips each element by value" in source
    for card in SHIPPED_HEADS.glob("*/README.md"):
        text = card.read_text()
        assert "clips each element" in text and "512 / sequence length" in text, card
