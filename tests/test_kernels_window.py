"""The device window state (kernels.window) against a host reference written like specs/microspec.md 2.5.

`HostVocab` is the spec's `MicroSpecVocab` (plain lists and sets, one entry at a time) plus the
`fifo_unique` mode of ambiguity A4. The device state - torch path, Triton kernel and the C step of
kernels.cpu - must agree with it exactly after every step, and its slot map must stay consistent."""

import contextlib
import random

import pytest
import torch

from specvocab.kernels import cpu as cpu_kernels
from specvocab.kernels import window as wn
from specvocab.kernels.hardware import DEVICE, using_triton

_NO_C = (cpu_kernels.available_portable() or "") if DEVICE.type == "cpu" else "the window state is on CUDA"
_NO_AVX2 = ("the window state is on CUDA" if DEVICE.type != "cpu" else
            "" if cpu_kernels.builds.library_reason("avx2") is None else
            f"needs AVX2 + FMA (this CPU: {cpu_kernels.cpu_isa()}): {cpu_kernels.builds.library_reason('avx2')}")
BACKENDS = pytest.mark.parametrize("backend", [
    "triton", "torch",
    pytest.param("c", marks=pytest.mark.skipif(bool(_NO_C), reason=f"the C window step does not run: {_NO_C}")),
    pytest.param("c-avx2", marks=pytest.mark.skipif(bool(_NO_AVX2), reason=_NO_AVX2))])


@contextlib.contextmanager
def on(backend: str):
    """Run window steps on one backend: the Triton kernel, the torch reference, or the C step (CPU) - from the
    library the CPU picks, or (c-avx2) from the AVX2 build, as a CPU without AVX-512 runs it."""
    with (using_triton(backend == "triton"), wn.using_c_step(backend.startswith("c")),
          pytest.MonkeyPatch.context() as mp):
        if backend == "c-avx2":
            mp.setenv(cpu_kernels.ISA_ENV, "avx2")
            assert cpu_kernels.provider("window_step").library == "avx2"
        yield
MODES = pytest.mark.parametrize("mode", wn.MODES)


def ids(values):
    """Token ids on the device the kernels run on (CPU + interpreter here, CUDA when there is one)."""
    return torch.as_tensor(list(values), dtype=torch.long, device=DEVICE)


class HostVocab:
    """I = Unique(Suffix(S, W_max)), maintained one entry at a time (spec section 2.5)."""

    def __init__(self, V, W_max, mode="eq4_exact"):
        self.V, self.W, self.mode = V, W_max, mode
        self.ring = [None] * W_max
        self.n_appended = 0
        self.stream_len = 0
        self.cnt = [0] * V
        self.active = [False] * V
        self.touched = []

    def _push(self, v):
        p = self.n_appended % self.W
        old = self.ring[p]
        if old is not None:
            self.cnt[old] -= 1
            self.touched.append(old)
        self.ring[p] = v
        self.cnt[v] += 1
        self.touched.append(v)
        self.n_appended += 1

    def step(self, entries):
        """Push one step's entries (negative = padding), commit; returns the entered tokens in the
        order they were first pushed this step."""
        entries = [v for v in entries if v >= 0]
        if self.mode == "fifo_unique":   # push Unique(entries) minus the active vocab, keep-first
            seen, kept = set(), []
            for v in entries:
                if v not in seen and not self.active[v]:
                    seen.add(v)
                    kept.append(v)
            entries = kept
        for v in entries:
            self._push(v)
        self.stream_len += len(entries)
        return self.commit(pushed=entries)

    def commit(self, pushed):
        entered = [v for v in dict.fromkeys(pushed) if self.cnt[v] > 0 and not self.active[v]]
        for v in set(self.touched):
            self.active[v] = self.cnt[v] > 0
        self.touched.clear()
        return entered

    def active_set(self):
        return {v for v in range(self.V) if self.active[v]}


def assert_agrees(state, host, gathered=None, entered=None):
    W = state.w_max
    assert set(torch.nonzero(state.active).flatten().tolist()) == host.active_set()
    assert state.cnt.tolist() == host.cnt
    assert state.ring.tolist() == [-1 if v is None else v for v in host.ring]
    assert int(state.ring_head) == host.n_appended and int(state.stream_len) == host.stream_len
    # slot map: a bijection between active tokens and used slots; the free stack holds the rest
    active = torch.nonzero(state.active).flatten()
    slots = state.slot_of[active].long()
    assert (slots >= 0).all() and torch.equal(state.tok_of_slot[slots].long(), active)
    assert (state.slot_of[~state.active] == -1).all()
    used = state.tok_of_slot >= 0
    assert int(used.sum()) == active.numel() == int(state.active_size())
    free = state.free_slots[: int(state.free_top)].long()
    assert sorted(free.tolist() + slots.tolist()) == list(range(W))
    assert not used[free].any()
    assert (state.first_pos == 2**31 - 1).all(), "the dedup scratch must be left idle"
    if gathered is not None:
        n = int(gathered.count)
        assert gathered.tokens[:n].tolist() == entered
        assert torch.equal(gathered.slots[:n], state.slot_of[gathered.tokens[:n]].long())
        assert (gathered.slots[n:] == -1).all() and (gathered.tokens[n:] == -1).all()


def random_entries(rng, V, m, pad_rate=0.1, hot=None):
    hot = hot or V
    return [-1 if rng.random() < pad_rate else rng.randrange(hot if rng.random() < 0.7 else V) for _ in range(m)]


@BACKENDS
@MODES
@pytest.mark.parametrize("V,W", [(5, 1), (7, 3), (60, 16), (300, 63), (40, 40)])
def test_random_streams_match_host_reference(V, W, mode, backend):
    rng = random.Random(V * 1000 + W)
    state = wn.new_window_state(V, W, DEVICE, mode)
    host = HostVocab(V, W, mode)
    with on(backend):
        prompt = random_entries(rng, V, rng.randrange(0, 3 * W + 2))
        gathered = wn.window_init(state, ids(prompt))
        # spec 2.5 note: init pushes only the last W_max entries of S_init; stream_len keeps the true |S|
        stream = [v for v in prompt if v >= 0]                          # S, literally (eq4_exact)
        if mode == "fifo_unique":
            stream = list(dict.fromkeys(stream))
        entered = host.step(stream[-W:])
        host.stream_len = len(stream)
        assert_agrees(state, host, gathered, entered)
        for _ in range(25):
            m = rng.choice([0, 1, W, rng.randrange(0, W + 1)])
            entries = random_entries(rng, V, m, hot=max(2, V // 4))
            gathered = wn.window_step(state, ids(entries))
            entered = host.step(entries)
            assert_agrees(state, host, gathered, entered)
            if mode == "eq4_exact":                                     # Eq. 4 read off the definition
                stream += [v for v in entries if v >= 0]
                assert host.active_set() == set(stream[-W:])


@MODES
def test_triton_kernel_torch_path_and_c_step_are_bit_identical(mode):
    rng = random.Random(5)
    V, W = 120, 31
    backends = ["triton", "torch"] + ([] if _NO_C else ["c"]) + ([] if _NO_AVX2 else ["c-avx2"])
    states = {b: wn.new_window_state(V, W, DEVICE, mode) for b in backends}
    for step in range(40):
        entries = torch.tensor(random_entries(rng, V, rng.randrange(0, W + 1), hot=30), dtype=torch.long,
                               device=DEVICE)
        out = {}
        for backend, state in states.items():
            with on(backend):
                out[backend] = wn.window_step(state, entries)
        for other in backends[1:]:
            for name in ("ring", "ring_head", "stream_len", "cnt", "active", "slot_of", "tok_of_slot", "free_top",
                         "first_pos"):
                assert torch.equal(getattr(states["triton"], name), getattr(states[other], name)), (step, other, name)
            top = int(states["triton"].free_top)
            assert torch.equal(states["triton"].free_slots[:top], states[other].free_slots[:top])
            for a, b in zip(out["triton"], out[other]):
                assert torch.equal(a, b), (step, other)


@BACKENDS
def test_full_window_turns_over_completely(backend):
    V, W = 64, 8
    state = wn.new_window_state(V, W, DEVICE)
    with on(backend):
        for step in range(6):
            entries = ids(range(step * W, (step + 1) * W)) % V        # W fresh tokens per step
            gathered = wn.window_step(state, entries)
            assert int(gathered.count) == W and int(state.free_top) == 0 and int(state.active_size()) == W
            assert torch.equal(gathered.tokens, entries)
            assert sorted(gathered.slots.tolist()) == list(range(W))
            assert torch.equal(state.tok_of_slot[gathered.slots].long(), entries)


@BACKENDS
def test_eq4_refreshes_and_fifo_unique_does_not(backend):
    """Spec A4 by hand: W=3, S_init = (1, 2, 3), then one step appends (1, 4)."""
    expected = {"eq4_exact": {1, 3, 4},      # ring 1 2 3 -> 4 1 3 (push 1 evicts 1, push 4 evicts 2)
                "fifo_unique": {2, 3, 4}}    # 1 is active, not pushed; 4 evicts 1
    with on(backend):
        for mode, active in expected.items():
            state = wn.new_window_state(10, 3, DEVICE, mode)
            wn.window_init(state, ids([1, 2, 3]))
            gathered = wn.window_step(state, ids([1, 4]))
            assert set(torch.nonzero(state.active).flatten().tolist()) == active
            assert gathered.tokens[: int(gathered.count)].tolist() == [4]


@BACKENDS
def test_empty_and_all_padding_steps_change_nothing(backend):
    state = wn.new_window_state(30, 5, DEVICE)
    with on(backend):
        wn.window_init(state, ids([3, 4, 3, 9]))
        before = {k: v.clone() for k, v in vars(state).items() if isinstance(v, torch.Tensor)}
        for entries in (ids([]), ids([-1] * 5)):
            gathered = wn.window_step(state, entries)
            assert int(gathered.count) == 0
            for k, v in before.items():
                assert torch.equal(getattr(state, k), v), k


def test_window_init_keeps_only_the_suffix_and_counts_the_stream():
    state = wn.new_window_state(100, 4, DEVICE)
    prompt = ids([5, 6, -1, 7, 8, 9, 10, -1])                          # 6 valid entries, W = 4
    gathered = wn.window_init(state, prompt)
    assert set(torch.nonzero(state.active).flatten().tolist()) == {7, 8, 9, 10}
    assert int(state.stream_len) == 6 and int(state.ring_head) == 4
    assert gathered.tokens[: int(gathered.count)].tolist() == [7, 8, 9, 10]
    wn.window_init(state, ids([1]))                                     # a new generate(): reset (spec A5)
    assert torch.nonzero(state.active).flatten().tolist() == [1] and int(state.stream_len) == 1


@BACKENDS
@MODES
@pytest.mark.parametrize("V,W", [(7, 3), (60, 8), (300, 31)])
def test_steps_longer_than_the_window_match_host_reference(V, W, mode, backend):
    """One step may bring more than w_max entries, padding included (a large draft tree, a small window):
    the -1 lanes are skipped before the last w_max entries are taken, as if pushed one by one."""
    rng = random.Random(V + W)
    state = wn.new_window_state(V, W, DEVICE, mode)
    host = HostVocab(V, W, mode)
    stream = []
    with on(backend):
        for _ in range(20):
            entries = random_entries(rng, V, rng.randrange(W + 1, 4 * W + 2), pad_rate=0.5, hot=max(2, V // 4))
            gathered = wn.window_step(state, ids(entries))
            entered = host.step(entries)
            assert_agrees(state, host)
            n = int(gathered.count)
            assert sorted(gathered.tokens[:n].tolist()) == sorted(entered)
            assert torch.equal(gathered.slots[:n], state.slot_of[gathered.tokens[:n]].long())
            if mode == "eq4_exact":
                stream += [v for v in entries if v >= 0]
                assert host.active_set() == set(stream[-W:])


def test_bad_arguments_name_the_problem():
    state = wn.new_window_state(10, 4, DEVICE)
    with pytest.raises(wn.WindowError, match="integer"):
        wn.window_step(state, torch.zeros(2, device=DEVICE))
    with pytest.raises(wn.WindowError, match="unknown window mode .lru.*eq4_exact"):
        wn.new_window_state(10, 4, DEVICE, mode="lru")


@BACKENDS
@pytest.mark.parametrize("m", [0, 1, 17, 63, 300])
def test_unique_new_keeps_first_occurrences_in_order(m, backend):
    rng = random.Random(m)
    V = 50
    candidates = [rng.randrange(-1, V) for _ in range(m)]
    exclude = torch.zeros(V, dtype=torch.bool, device=DEVICE)
    exclude[::7] = True
    for ex in (None, exclude):
        with on(backend):
            uniq, count = wn.unique_new(ids(candidates), V, ex)
        expected = [v for v in dict.fromkeys(candidates) if v >= 0 and (ex is None or not ex[v])]
        assert uniq.shape == (m,) and int(count) == len(expected)
        assert uniq[: len(expected)].tolist() == expected and (uniq[len(expected):] == -1).all()


def test_unique_new_triton_leaves_its_scratch_idle():
    scratch = torch.full((20,), 2**31 - 1, dtype=torch.int32, device=DEVICE)
    uniq, count = wn.unique_new_triton(ids([3, 3, 19, 0, 19]), 20, scratch=scratch)
    assert uniq[: int(count)].tolist() == [3, 19, 0] and (scratch == 2**31 - 1).all()
