"""Ground-truth coverage and temporal locality of candidate streams.

`locality` is pure and token-only: functions take token-id arrays, `Trace`s or polars frames and return
polars frames. Every analysis accepts plain token ids as well as Traces: one stream (a sequence of ints or a
1-D array), or one stream per text (`as_traces`, `Trace.from_tokens`: the first id of each is the prompt);
the window over the tokens themselves is `stream="generated"`. What needs the target's top-k rows (the
candidate stream's k_pre / k_ver sources, the successor store) refuses bare ids in one line. No model,
tokenizer or GPU inside, and nothing from `engine`: traces are recorded by
`python -m specvocab.engine.jobs.record` (or `engine.generate(..., record=True).to_trace()`) and read here.

Glossary (one word for one thing, across modules, notebooks and Parquet columns)
---------------------------------------------------------------------------------
target            the model whose greedy/sampled output must be reproduced exactly.
method            how a run drafts: ar | pld | hf-prompt-lookup | recycling | unispec | layerskip | eagle
                  (`engine.config.METHODS`); ar drafts nothing.
drafter           the object that proposes one draft tree per step for a method (`engine.drafters`);
                  layerskip and eagle end in an LM head, which a policy restricts.
policy            which rows of that LM head the drafter scores: full | frspec | microspec | oracle |
                  dynaspec; its size (`vocab_size` in results) is frspec's K or microspec's w_max.
run               one labelled configuration in a results table, e.g. `layerskip` or `frspec:1024`
                  (method, policy and size in one string; the `run` column).
step              one draft-verify cycle: the target runs one forward over the draft tree; the prefill counts
                  as step 0 (it yields the first token), so autoregressive decoding has tau = 1.00. `steps`
                  counts these cycles, and nothing else.
tokens            a count of generated tokens (`tokens` columns; tokens = steps only when every step commits
                  one token, as in autoregressive decoding and in the "token" event order of a stream).
root              the last committed token, not yet in the KV cache; node 0 of every draft tree.
draft tree        the nodes proposed in one step: `tokens [n]`, `parents [n]` (-1 for the root), `scores [n]`.
draft token       a non-root node of the draft tree.
g                 the draft size: draft tokens per step, root excluded (config field `draft_size`; `g` in
                  results is its mean over drafted steps).
accepted token    a draft token on the longest path that matches the target (greedy) or survives rejection
                  sampling.
bonus token       the token the target itself emits after the last accepted token (every step has one).
recovered token   a bonus token sampled from the residual distribution after a rejection (sampling mode).
tau               mean tokens committed per step, bonus included (the Spec-Bench "accept length").
candidate stream  S: MicroSpec's sequence of token ids - prompt tokens, then the top-k_pre of every prefill
                  row, then per step the draft-tree tokens and the top-k_ver of the verify rows.
window            the last w_max entries of S; the active vocabulary I_t = Unique(Suffix(S, w_max)).
active vocab      I_t; `mean_active_vocab` is its mean size over steps.
coverage          the fraction of generated tokens y_t with y_t in the vocabulary the drafter had at the step
                  that committed y_t; `bonus_coverage` the same over each step's bonus token.
reuse distance    for y_t: the number of stream entries since its latest occurrence in S (inf if never);
                  y_t is covered by a window of w_max iff its reuse distance <= w_max.
stack distance    LRU stack distance: the number of distinct tokens seen since y_t's latest occurrence, + 1.
"""

from specvocab.locality.trace import (META_COLUMNS, Trace, TraceError, as_traces, read_traces, traces_to_frame,
                                      write_traces)
from specvocab.locality.stream import LocalityError, Stream, StreamIndex, candidate_stream, generated_stream
from specvocab.locality.coverage import coverage, coverage_by, coverage_report
from specvocab.locality.temporal import distance_histograms, miss_ratio_curves, token_distances
# `shortlist(ranking, k)` stays at locality.shortlist.shortlist: exporting it here would hide the module
from specvocab.locality.shortlist import (ShortlistError, count_tokens, load_ranking, ranking_from_traces, save_ranking,
                                shortlist_coverage, shortlist_coverage_by)
from specvocab.locality.successor import successor_coverage, successor_ranks

__all__ = ["META_COLUMNS", "Trace", "TraceError", "as_traces", "read_traces", "traces_to_frame", "write_traces",
           # candidate stream and window coverage (locality.stream, locality.coverage)
           "LocalityError", "Stream", "StreamIndex", "candidate_stream", "generated_stream",
           "coverage", "coverage_by", "coverage_report",
           # temporal locality (locality.temporal)
           "token_distances", "distance_histograms", "miss_ratio_curves",
           # static shortlists (locality.shortlist)
           "ShortlistError", "count_tokens", "ranking_from_traces", "save_ranking", "load_ranking",
           "shortlist_coverage", "shortlist_coverage_by",
           # UniSpec successor store (locality.successor)
           "successor_ranks", "successor_coverage"]
