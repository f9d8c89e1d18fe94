"""Plain, obviously correct per-step references for the `locality` metrics: Python lists, sets, loops.

Written from the definitions (MicroSpec §2.2 and §3.2, Eq. 2-4; the event orders in `locality.stream`), not
from the fast code, and slow on purpose. The tests assert the vectorised paths agree with these exactly.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


def ordered_unique(seq):
    seen, out = set(), []
    for v in seq:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def candidate_events(trace, k_pre=3, k_ver=3, sources="ctx+ext", prefill_order="first"):
    """(S_init, [(y_t, appended_after_t)]) for one trace, as Python lists."""
    prompt = [int(v) for v in trace.prompt]
    rows = [list(map(int, r[:k_pre])) for r in trace.prefill_topk]
    if len(trace.generated):
        rows.append(list(map(int, trace.step_topk[0][:k_pre])))       # the last prompt position
    flat = [v for r in rows for v in r]
    if prefill_order == "first":
        union = ordered_unique(flat)
    else:
        last = {v: i for i, v in enumerate(flat)}
        union = sorted(last, key=last.get)
    if sources == "ext":
        s_init = list(map(int, trace.step_topk[0][:k_pre])) if len(trace.generated) else []
    else:
        s_init = prompt + union
    T = len(trace.generated)
    drafts = None
    if trace.draft_tokens is not None:
        if len(trace.draft_tokens) == T:
            drafts = [[int(v) for v in d] for d in trace.draft_tokens]
        else:                            # one list per step: after the last token the step committed
            drafts, done = [[] for _ in range(T)], 0
            for size, d in zip(trace.meta["step_sizes"], trace.draft_tokens):
                done += size
                if T:
                    drafts[min(done, T) - 1] += [int(v) for v in d]
    steps = []
    for t, y in enumerate(trace.generated):
        app = []
        if sources != "ctx":
            if drafts is not None:
                app += ordered_unique(drafts[t])
            app += [int(v) for v in trace.step_topk[t][:k_ver]]
        steps.append((int(y), app))
    return s_init, steps


def engine_events(trace, k_pre=3, k_ver=3, sources="ctx+ext", prefill_order="first"):
    """(S_init, [(tokens the step committed, appended after the step)]) for the drafted steps s = 1, 2, ...
    of one trace: the engine's own window, frozen during a step (`event_order="engine"`)."""
    s_init, _ = candidate_events(trace, k_pre, k_ver, sources, prefill_order)
    gen = [int(v) for v in trace.generated]
    sizes = trace.meta.get("step_sizes") or [1] * len(gen)          # no sizes: one token per step
    trees = trace.draft_tokens if trace.draft_tokens is not None else [[] for _ in sizes]
    steps, start = [], 0
    for s, (size, tree) in enumerate(zip(sizes, trees)):
        end = min(start + size, len(gen))
        if s > 0:                                                     # step 0 is the prefill: not drafted
            app = []
            if sources != "ctx":
                app += ordered_unique([gen[start - 1]] + [int(v) for v in tree])       # C_draft, root first
                app += ordered_unique([int(v) for t in range(start, end) for v in trace.step_topk[t][:k_ver]])
            steps.append((gen[start:end], app))
        start = end
    return s_init, steps


def engine_window(traces, w, **kw):
    """[(covered flag of each token of the step, |I_s|)] for every drafted step of every trace."""
    out = []
    for tr in traces:
        s, steps = engine_events(tr, **kw)
        s = list(s)
        for ys, app in steps:
            active = set(s[max(0, len(s) - w):])
            out.append(([y in active for y in ys], len(active)))
            s.extend(app)
    return out


def engine_coverage(traces, w, **kw):
    """(covered tokens, tokens, covered bonus tokens, Sum_s |I_s|, steps) of the engine order."""
    per = [(flags, size) for flags, size in engine_window(traces, w, **kw) if flags]
    return (sum(sum(f) for f, _ in per), sum(len(f) for f, _ in per), sum(f[-1] for f, _ in per),
            sum(a for _, a in per), len(per))


def generated_events(trace):
    s_init = [int(v) for v in trace.prompt]
    return s_init, [(int(y), [int(y)]) for y in trace.generated]


def window_per_step(traces, w, events=candidate_events, **kw):
    """[(covered, |I_t|)] for every step of every trace: I_t = set of the last w entries of S."""
    out = []
    for tr in traces:
        s, steps = events(tr, **kw)
        s = list(s)
        for y, app in steps:
            active = set(s[max(0, len(s) - w):])
            out.append((y in active, len(active)))
            s.extend(app)
    return out


def coverage(traces, w, **kw):
    """(covered steps, Sum |I_t|, steps) of the FIFO window w."""
    per = window_per_step(traces, w, **kw)
    return sum(c for c, _ in per), sum(a for _, a in per), len(per)


def distances(traces, events=candidate_events, **kw):
    """[(reuse distance, stack distance)] per step; None when the token never occurred before."""
    out = []
    for tr in traces:
        s, steps = events(tr, **kw)
        s = list(s)
        for y, app in steps:
            n = len(s)
            p = next((j for j in range(n - 1, -1, -1) if s[j] == y), None)
            if p is None:
                out.append((None, None))
            else:
                out.append((n - p, len(set(s[p + 1:n])) + 1))
            s.extend(app)
    return out


def lru_per_step(traces, capacity, events=candidate_events, **kw):
    """[(covered, |I_t|)] for an LRU vocabulary: I_t = the `capacity` most recently seen distinct tokens."""
    out = []
    for tr in traces:
        s, steps = events(tr, **kw)
        lru = OrderedDict()
        for v in s:
            lru.pop(v, None)
            lru[v] = True
        for y, app in steps:
            recent = list(lru)[-capacity:] if capacity else []
            out.append((y in recent, len(recent)))
            for v in app:
                lru.pop(v, None)
                lru[v] = True
    return out


def successor_ranks(traces, persist=False, from_prefill=True):
    """Per step (trace order): (0-based rank of generated[t] in the store row of its root, root has a row).
    The rank is None when the root has no row or the token is not in it.

    Positions j = 0 .. L+T-2 of prompt ⊕ generated are processed in order; processing j writes
    store[x_j] = rows[j] (overwrite), rows = prefill_topk rows then step_topk rows (rows[L-1] =
    step_topk[0]). Step t drafts from store[root], root = x_{L+t-1}, just before the root is processed.
    """
    out = []
    stores = {}
    for tr in traces:
        store = stores.setdefault(tr.meta.get("model"), {}) if persist else {}
        x = [int(v) for v in tr.prompt] + [int(v) for v in tr.generated]
        L = len(tr.prompt)
        rows = [list(map(int, r)) for r in tr.prefill_topk] + [list(map(int, r)) for r in tr.step_topk]
        done = 0

        def process(upto):
            nonlocal done
            while done < upto:
                if from_prefill or done >= L:
                    store[x[done]] = rows[done]
                done += 1

        for t, y in enumerate(tr.generated):
            root = L + t - 1
            process(root)
            row = store.get(x[root])
            out.append((row.index(int(y)) if row is not None and int(y) in row else None, row is not None))
        process(len(rows))
    return out


def frequency_ranking(arrays, vocab_size):
    """token id -> 0-based rank: by count descending, ties by first occurrence, unseen ids after by id."""
    cnt = Counter()
    first = {}
    i = 0
    for a in arrays:
        for v in a:
            v = int(v)
            cnt[v] += 1
            first.setdefault(v, i)
            i += 1
    seen = sorted(cnt, key=lambda v: (-cnt[v], first[v]))
    unseen = [v for v in range(vocab_size) if v not in cnt]
    return {v: r for r, v in enumerate(seen + unseen)}, cnt
