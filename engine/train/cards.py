"""The model cards (`README.md`) a training run writes beside its head, and the learning-curve table."""

from __future__ import annotations

import dataclasses

from specvocab.engine.train.data import DataConfig
# fields a card's command does not repeat: where things go, how the run shows progress, how it was sliced
_NOT_IN_COMMAND = ("model", "data", "out", "progress", "run_minutes", "device", "betas")  # betas: in the loss line


def changed_flags(cls, values: dict) -> list[str]:
    """The `--flag value` words (as `engine.jobs.args.add_fields` names them) for each field of dataclass `cls`
    whose value in `values` is not the field's default: the command line that sets what `values` holds."""
    words = []
    for f in dataclasses.fields(cls):
        if f.name in _NOT_IN_COMMAND or f.name not in values or f.default is dataclasses.MISSING:
            continue
        v, d = values[f.name], f.default
        v, d = (list(x) if isinstance(x, tuple) else x for x in (v, d))
        if v == d or v is None or (isinstance(v, bool) and not v):   # a True default has no flag to undo it
            continue
        flag = "--" + f.name.replace("_", "-")
        words.append(flag if isinstance(v, bool) else f"{flag} {','.join(map(str, v)) if isinstance(v, list) else v}")
    return words


def data_command(model: str, settings: dict) -> str:
    """The `eagle_data` command that makes a data folder of these settings (its manifest's)."""
    rest = {k: v for k, v in settings.items() if k not in ("sources", "num_prompts", "store_features")}
    return " ".join([f"python -m specvocab.engine.jobs.eagle_data --model {model}",
                     f"--source {','.join(settings['sources'])}",
                     f"--num-prompts {settings['num_prompts'] if settings['num_prompts'] is not None else 'all'}",
                     *(["--no-store-features"] if settings.get("store_features", True) is False else []),
                     *changed_flags(DataConfig, rest), "--out <data>"])


def train_command(job: str, cfg) -> str:
    """The `job` command (train_eagle | train_eagle3) that runs cfg's training on the folder `<data>`."""
    return " ".join([f"python -m specvocab.engine.jobs.{job} --model {cfg.model} --data <data>",
                     *changed_flags(type(cfg), dataclasses.asdict(cfg)), "--out <dir>"])


def budget_line(cfg, summary: dict) -> str:
    """The tokens and steps behind the head, and whether the run's budget is spent or the run goes on."""
    line = f"- {summary['tokens_seen']:,} training tokens in {summary['steps']} steps of ~{cfg.batch_tokens} tokens"
    if not summary.get("finished", True):
        line += (f" (a run stopped on the way: its budget is {cfg.tokens:,} tokens; the same command continues it "
                 f"from the checkpoint)")
    return line


def eagle2_card(cfg, summary: dict, curve: list[dict]) -> str:
    d, u = summary["data_settings"], summary["data_used"]
    lines = [f"# EAGLE-2 draft head for `{cfg.model}`", "",
             "An EAGLE-1/2 head (fc over [token embedding; target feature] + one Llama decoder layer without input "
             "norm; the target's embedding and LM head are used frozen and not stored), in the official EAGLE "
             "checkpoint layout. Made by `specvocab` (`engine.jobs.train_eagle`).", "",
             "## Data", "",
             f"- prompts: `{d['prompts']}` (the training corpus of the data root; disjoint from every benchmark), "
             f"shuffled with seed {d['seed']}; used: {u['train_prompts']} prompts / {u['train_tokens']:,} tokens "
             f"for training, {u['heldout_prompts']} prompts / {u['heldout_tokens']:,} tokens held out",
             f"- sources: {', '.join(d['sources'])} ("
             + "; ".join(x for x in ("teacher = the prompt + the corpus's reference response" if "teacher" in d["sources"] else "",
                                     f"greedy = the prompt + the target's own greedy continuation, {d['greedy_new_tokens']} "
                                     f"tokens" if "greedy" in d["sources"] else "") if x) + ")",
             f"- sequences cut at {d['max_tokens']} tokens; prompts over {d['max_prompt_tokens']} tokens skipped", "",
             "## Command", "", "```", data_command(cfg.model, d), train_command("train_eagle", cfg), "```", "",
             "## Budget", "",
             f"{budget_line(cfg, summary)}; {summary['train_seconds_this_run']:.0f} s of wall time in the run that "
             "finished it"
             + (f" ({cfg.threads} CPU threads)" if cfg.threads else ""),
             f"- loss: SmoothL1 on features / RMS x {cfg.w_reg} + cross-entropy on the target's top-k x {cfg.w_cls}; "
             f"AdamW lr {cfg.lr}, betas {list(cfg.betas)}, warmup {cfg.warmup_steps} steps, cosine; "
             f"feature noise U(-0.5, 0.5) x {cfg.noise} x RMS (EAGLE's code: x 0.2 x 512 / sequence length); "
             f"gradients clipped to global norm {cfg.grad_clip} (EAGLE's code clips each element to +-0.5); "
             f"trained from scratch, as EAGLE's heads are",
             f"- loss on {'every position' if cfg.loss_on == 'all' else 'response positions'}; cross-entropy on "
             f"{cfg.cls_rows or 'all'} random rows per step, LM-head matmul in {cfg.head_dtype}; the data's "
             f"target ran in {d.get('dtype') or 'the default dtype'}", "",
             "## Result (held-out prompts of the training corpus)", "",
             f"- top-1 agreement with the target (teacher forced): {summary['heldout_top1']:.3f}",
             f"- tau (tokens per draft-verify step, greedy, full vocabulary, depth {summary['eval']['eagle_depth']}, "
             f"top-k {summary['eval']['eagle_topk']}, default draft size, {summary['eval']['prompts']} prompts x "
             f"{summary['eval']['new_tokens']} tokens): {summary['heldout_tau']:.2f}", "",
             "| tokens | held-out top-1 | held-out tau | held-out loss |", "|---|---|---|---|"]
    lines += [f"| {p['tokens']:,} | {p['heldout_top1']:.3f} | {p['heldout_tau']:.2f} | {p['heldout_loss']:.3f} |"
              for p in curve]
    lines += ["", "## Reproducing", "",
              "The same commands make the same data (fixed seeds, greedy decoding) and the same schedule; the head "
              "is not bit-identical across machines or thread counts (CPU matmul reductions), so held-out top-1 "
              "and tau are the figures to compare.", ""]
    return "\n".join(lines)


def learning_curve_table(curve: list[dict]) -> str:
    lines = ["| tokens | held-out top-1 (step 0) | held-out top-1 (last TTT step) | held-out tau | held-out loss |",
             "|---|---|---|---|---|"]
    lines += [f"| {p['tokens']:,} | {p['heldout_top1']:.3f} | {p['heldout_top1_last_step']:.3f} | "
              f"{p['heldout_tau']:.2f} | {p['heldout_loss']:.3f} |" for p in curve]
    return "\n".join(lines)


def eagle3_card(cfg, summary: dict, curve: list[dict]) -> str:
    d, u, dv = summary["data_settings"], summary["data_used"], summary["draft_vocab"]
    sources = "; ".join(x for x in (
        "teacher = the prompt + the corpus's reference response" if "teacher" in d["sources"] else "",
        f"greedy = the prompt + the target's own greedy continuation, {d['greedy_new_tokens']} tokens"
        if "greedy" in d["sources"] else "") if x)
    lines = [f"# EAGLE-3 draft head for `{cfg.model}`", "",
             "An EAGLE-3 head (fc over the target's low / mid / high layer features "
             f"(the residual stream entering decoder layers {summary['feature_layers']}), one midlayer over "
             "[embedding; hidden], norm, lm_head over its own draft vocabulary with d2t / t2d; the target's "
             "embedding is used frozen and not stored), in the official EAGLE-3 checkpoint layout. Made by "
             "`specvocab` (`engine.jobs.train_eagle3`).", "",
             "## Data", "",
             f"- prompts: `{d['prompts']}` (the training corpus of the data root; disjoint from every benchmark), "
             f"shuffled with seed {d['seed']}; used: {u['train_prompts']} prompts / {u['train_tokens']:,} tokens "
             f"for training, {u['heldout_prompts']} prompts / {u['heldout_tokens']:,} tokens held out",
             f"- sources: {', '.join(d['sources'])} ({sources})",
             f"- sequences cut at {d['max_tokens']} tokens; prompts over {d['max_prompt_tokens']} tokens skipped", "",
             "## Draft vocabulary", "",
             f"- {dv['size']:,} ids (asked: {dv['requested']:,}"
             + (f"; the data holds only {dv['distinct_seen']:,} distinct counted tokens" if dv["distinct_seen"] else "")
             + f"), the most frequent {'target top-1 tokens at the loss positions' if dv['counted'] == 'top1' else 'response tokens'} "
             f"of the training split; they cover {dv['coverage']:.1%} of those tokens. Positions whose target top-1 "
             "is outside it get no loss (as EAGLE-3's training).", "",
             "## Command", "", "```", data_command(cfg.model, d), train_command("train_eagle3", cfg), "```", "",
             "## Budget", "",
             f"{budget_line(cfg, summary)}, each with {cfg.ttt_steps} training-time-test steps; "
             f"{summary['train_seconds_total']:.0f} s of wall time "
             f"over all runs" + (f" ({cfg.threads} CPU threads)" if cfg.threads else ""),
             f"- loss: sum over TTT steps k of {cfg.step_weight}^k x cross-entropy against the target's top-k "
             f"within the draft vocabulary (renormalised); AdamW lr {cfg.lr}, betas {list(cfg.betas)}, warmup "
             f"{cfg.warmup_steps} steps, cosine; grad clip {cfg.grad_clip}; loss on "
             f"{'every position' if cfg.loss_on == 'all' else 'response positions'}; LM-head matmul in "
             f"{cfg.head_dtype}; lm_head initialised from {'the target LM head rows' if cfg.lm_head_init == 'target' else 'random'}", "",
             "## Result (held-out prompts of the training corpus)", "",
             f"- top-1 agreement with the target (teacher forced, step 0): {summary['heldout_top1']:.3f}; by TTT "
             f"step: {', '.join(f'{a:.3f}' for a in summary['heldout_top1_by_step'])}",
             f"- tau (tokens per draft-verify step, greedy, the `eagle3` drafter, full draft vocabulary, depth "
             f"{summary['eval']['eagle_depth']}, top-k {summary['eval']['eagle_topk']}, default draft size, "
             f"{summary['eval']['prompts']} prompts x {summary['eval']['new_tokens']} tokens): "
             f"{summary['heldout_tau']:.2f}", "", learning_curve_table(curve), "",
             "## What differs from EAGLE's own training code", "",
             "- the target distribution is the target's top-k stored in the data shards (renormalised within the "
             "draft vocabulary), not its full softmax;",
             *(["- lm_head / norm start from the target's LM head and final norm (the official head starts "
                "random);"] if cfg.lm_head_init == "target" else []),
             "- learning rate, warmup and cosine schedule sized for a small head trained from scratch on a CPU "
             "(official: 5e-5, 12k warmup steps, linear decay, fp16, 40 epochs);",
             *(["- the loss covers the prompt's positions too (official: the response's only);"]
               if cfg.loss_on == "all" else []),
             *(["- the draft vocabulary is counted over the target's top-1 next tokens at the loss positions "
                "(official: the response tokens; the same tokens on the target's own greedy continuations);"]
               if dv["counted"] == "top1" else []),
             "- config.json adds `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang / vLLM read it) and a "
             "`specvocab` block; `embed_tokens.weight` is not stored (EAGLE's `ea_model.py` reads the target's "
             "embedding itself, `load_emb=True`, and loads the head with strict=False; not tried in EAGLE's code "
             "here).", "",
             "## Reproducing", "",
             "The same commands make the same data and the same schedule; a run interrupted and resumed gives the "
             "same head bit for bit on one machine, not across machines or thread counts (CPU matmul reductions).", ""]
    return "\n".join(lines)
