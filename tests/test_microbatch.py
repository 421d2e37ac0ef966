"""Micro-batching: MicroBatch against the reference, its workspace and name, best_split, find's offers."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from convtune import ConvProblem, Policy, Status, find
from convtune.algorithms.base import ALIGN_BYTES, Buffer, allocate_workspace
from convtune.algorithms.microbatch import MicroBatch, micro_batch_name, parse_micro_batch_name
from convtune.algorithms.registry import get_algorithm, isolated
from convtune.microbatch_search import best_split, sub_batch_sizes
from convtune.verify import check, reference_case, rel_error, tolerance
from fakes import CLOCK, CostlyWorkspace, Fake, FakeDB, FakeTimer


def aligned(nbytes):
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class Growing(Fake):
    """Workspace and time grow with the batch: ``bytes_per_sample`` * n, ``overhead_ms`` + ``ms_per_sample`` * n.

    Records the batch of every run in ``batches``.
    """

    def __init__(self, name="fake:growing", *, bytes_per_sample=1000, overhead_ms=0.05, ms_per_sample=0.1, **kw):
        super().__init__(name, **kw)
        self.bytes_per_sample, self.overhead_ms, self.ms_per_sample = bytes_per_sample, overhead_ms, ms_per_sample
        self.batches = []

    def buffers(self, problem):
        return [Buffer("scratch", (self.bytes_per_sample * problem.n,), torch.uint8)]

    def _run(self, problem, a, b, out, ws):
        self.batches.append(problem.n)
        CLOCK.advance(self.overhead_ms + self.ms_per_sample * problem.n)
        ws["scratch"].fill_(7)  # touches all of it: more would raise
        self.compute(problem, a, b, out)


class OffsetBlind(Growing):
    """Right on a tensor of its own, 1% off on a view that does not start its storage: a slice."""

    def compute(self, problem, a, b, out):
        super().compute(problem, a, b, out)
        if a.storage_offset():
            out.mul_(1.01)


def problem(direction, n=5, dtype="float32", layout="NCHW"):
    return ConvProblem(direction, n=n, c=4, k=6, input_size=(6, 5), kernel_size=3, padding=1, stride=(1, 2),
                       dtype=dtype, layout=layout)


# -- the algorithm ------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("inner", ["torch:native", "gemm:im2col"])
def test_micro_batched_equals_whole_batch(direction, layout, dtype, inner):
    p = problem(direction, dtype=dtype, layout=layout)
    whole = get_algorithm(inner, p)
    mb = MicroBatch(whole, [(3, 1), (2, 1)])  # uneven: 3 + 2
    inputs, ref = reference_case(p, seed=3)
    _, ok, message = check(mb, p, inputs, ref, p.empty(p.operand_shapes[2]), None)
    assert ok, message
    bound = tolerance(p, mb.notes(p))
    assert rel_error(whole.run(p, *inputs), ref) <= bound
    # Close to the whole-batch result, within what the dtype allows.
    assert rel_error(mb.run(p, *inputs), whole.run(p, *inputs).double()) <= 2 * bound


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bwd_filter_sums_every_slice_into_one_gradient(dtype, layout):
    p = problem("bwd_filter", n=5, dtype=dtype, layout=layout)
    inner = Growing()
    mb = MicroBatch(inner, [(2, 2), (1, 1)])
    inputs, ref = reference_case(p, seed=5)
    _, ok, message = check(mb, p, inputs, ref, p.empty(p.w_shape), None)
    assert ok, message
    assert inner.batches == [2, 2, 1]
    # Any one slice alone (what a gradient overwritten per slice would hold) is far off.
    x, dy = inputs
    one = get_algorithm("torch:native").run(p.replace(n=1), x[4:], dy[4:])
    assert rel_error(one, ref) > 0.1
    names = [b.name for b in mb.buffers(p)]
    assert names == (["inner", "partial"] if dtype == "float32" else ["inner", "partial", "accumulator"])


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_slices_run_in_order_on_the_right_rows(direction):
    p = problem(direction, n=7)
    inner = Growing()
    mb = MicroBatch(inner, [(3, 2), (1, 1)])
    assert mb.slices() == [(0, 3), (3, 6), (6, 7)]
    inputs, ref = reference_case(p, seed=1)
    out = mb.run(p, *inputs)
    assert inner.batches == [3, 3, 1]
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("direction, dtype, extra", [
    ("fwd", "float32", 0),
    ("bwd_data", "bfloat16", 0),
    ("bwd_filter", "float32", aligned(6 * 4 * 9 * 4)),
    ("bwd_filter", "bfloat16", aligned(6 * 4 * 9 * 2) + aligned(6 * 4 * 9 * 4)),
])
def test_workspace_is_the_largest_sub_batch_plus_the_accumulator(direction, dtype, extra):
    p = problem(direction, n=9, dtype=dtype)
    inner = Growing(bytes_per_sample=1000)
    mb = MicroBatch(inner, [(4, 2), (1, 1)])
    assert mb.buffer_bytes(p) == aligned(4000) + extra
    assert mb.buffer_bytes(p) < inner.buffer_bytes(p)
    # Runs in exactly what it declares (Growing fills its whole scratch each run).
    inputs, ref = reference_case(p)
    out = mb.run(p, *inputs, workspace=allocate_workspace(mb.buffer_bytes(p), "cpu"))
    assert rel_error(out, ref) <= tolerance(p, mb.notes(p))


def test_a_split_knows_its_workspace_without_building_only_once_every_inner_does():
    p = problem("bwd_filter", n=6)
    inner = CostlyWorkspace("fake:costly", workspace_bytes=1000)
    mb = MicroBatch(inner, [(4, 1), (2, 1)])
    assert mb.known_workspace_bytes(p) is None and inner.builds == 0
    inner.workspace_bytes(problem("bwd_filter", n=4))
    assert mb.known_workspace_bytes(p) is None and inner.builds == 1  # the sub-batch of 2 is not built yet
    assert mb.workspace_bytes(p) == mb.known_workspace_bytes(p) == aligned(1000) + aligned(6 * 4 * 9 * 4)
    assert inner.builds == 2


def test_one_slice_needs_no_accumulator():
    p = problem("bwd_filter", n=4, dtype="bfloat16")
    assert [b.name for b in MicroBatch(Growing(), [(4, 1)]).buffers(p)] == ["inner"]


def test_support_and_properties_follow_the_inner():
    p = problem("fwd", n=5)
    assert not MicroBatch(Growing(), [(2, 2)]).supports(p)  # covers 4, not 5
    assert "batch of 4" in MicroBatch(Growing(), [(2, 2)]).supports(p).reason
    refusing = Fake("fake:refuses", unsupported_reason="only on Tuesdays")
    assert "only on Tuesdays" in MicroBatch(refusing, [(5, 1)]).supports(p).reason
    assert MicroBatch(Fake("fake:nd", deterministic=False), [(5, 1)]).is_deterministic(p) is False
    assert MicroBatch(Fake("fake:tf32", tf32=True), [(5, 1)]).notes(p).tf32


@pytest.mark.parametrize("split", [[], [(0, 1)], [(2, 0)], [(2,)], [(2.0, 1)], [(True, 1)]])
def test_bad_split_raises(split):
    with pytest.raises(ValueError, match="split"):
        MicroBatch(Growing(), split)


def test_nested_micro_batching_refused():
    with pytest.raises(ValueError, match="micro-batched already"):
        MicroBatch("mb:torch.native_s2x1", [(2, 1)])


# -- names --------------------------------------------------------------------------------------

def test_name_round_trip_through_get_algorithm():
    p = problem("bwd_filter", n=5)
    mb = MicroBatch(get_algorithm("gemm:im2col"), [(3, 1), (2, 1)])
    assert mb.name == "mb:gemm.im2col_s3x1_2x1"
    again = get_algorithm(mb.name, p)
    assert again.name == mb.name and again.split == ((3, 1), (2, 1)) and again.inner_name == "gemm:im2col"
    assert again.buffer_bytes(p) == mb.buffer_bytes(p)
    inputs, ref = reference_case(p)
    assert rel_error(again.run(p, *inputs), ref) <= tolerance(p, again.notes(p))


def test_name_of_a_plug_in_resolves_in_its_registry():
    fake = Growing("fake:grow_s3_w4")  # a variant holding '_s' like Triton's configurations
    p = problem("fwd", n=5)
    with isolated(fake):
        mb = get_algorithm("mb:fake.grow_s3_w4_s4x1_1x1", p)
        assert mb.inner_for(p.replace(n=4)) is fake
        assert mb.name == "mb:fake.grow_s3_w4_s4x1_1x1"


@pytest.mark.parametrize("inner, split", [("torch:native", ((1, 1),)), ("a_b:c.d=1-x_s2", ((16, 3), (2, 1)))])
def test_name_parse_inverts_name(inner, split):
    assert parse_micro_batch_name(micro_batch_name(inner, split)) == (inner, split)


@pytest.mark.parametrize("name, text", [
    ("mb:torch.native", "not a micro-batched"),
    ("mb:torch.native_s2", "not a micro-batched"),
    ("mb:torch.native_s2x2", "batch of 4"),        # the problem's batch is 5
    ("mb:nosuch.algo_s5x1", "not offered"),
])
def test_bad_names_raise_key_error(name, text):
    with pytest.raises(KeyError, match=text):
        get_algorithm(name, problem("fwd", n=5))


# -- the dynamic program -------------------------------------------------------------------------

def brute_force(n, options, limit):
    """Every multiset of usable sizes that adds up to n: the least time, and its least workspace."""
    sizes = [b for b, (t, w, _) in options.items() if b <= n and (limit is None or w <= limit)]
    best = None
    for counts in itertools.product(*[range(n // b + 1) for b in sizes]):
        if sum(b * c for b, c in zip(sizes, counts)) != n:
            continue
        time = sum(options[b][0] * c for b, c in zip(sizes, counts))
        ws = max((options[b][1] for b, c in zip(sizes, counts) if c), default=0)
        if best is None or (time, ws) < best:
            best = (time, ws)
    return best


@hsettings(max_examples=150, deadline=None)
@given(n=st.integers(1, 12),
       options=st.dictionaries(st.integers(1, 14), st.tuples(st.integers(1, 40), st.integers(0, 100)), max_size=5),
       limit=st.one_of(st.none(), st.integers(0, 100)))
def test_best_split_is_optimal_against_brute_force(n, options, limit):
    # Integer times keep sums exact, so ties compare exactly.
    opts = {b: (float(t), w, f"alg{b}") for b, (t, w) in options.items()}
    found = best_split(n, opts, limit)
    expected = brute_force(n, opts, limit)
    if expected is None:
        assert found is None
        return
    time, ws, split = found
    assert (time, ws) == expected
    assert sum(b * c for b, c, _ in split) == n
    assert time == sum(opts[b][0] * c for b, c, _ in split)
    assert ws == max(opts[b][1] for b, _, _ in split)
    assert all(limit is None or opts[b][1] <= limit for b, _, _ in split)
    assert all(alg == opts[b][2] for b, _, alg in split)
    assert [b for b, _, _ in split] == sorted({b for b, _, _ in split}, reverse=True)


def test_best_split_respects_the_limit_and_drops_bad_options():
    opts = {4: (1.0, 500, "a"), 2: (0.9, 300, "a"), 1: (0.5, 100, "a"), 3: (math.inf, 0, "a")}
    assert best_split(4, opts) == (1.0, 500, [(4, 1, "a")])
    assert best_split(4, opts, workspace_limit=400) == (1.8, 300, [(2, 2, "a")])
    assert best_split(4, opts, workspace_limit=100) == (2.0, 100, [(1, 4, "a")])
    assert best_split(4, opts, workspace_limit=50) is None


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_best_split_bad_batch(n):
    with pytest.raises(ValueError, match="batch"):
        best_split(n, {1: (1.0, 0, "a")})


def test_sub_batch_sizes():
    assert sub_batch_sizes(1) == []
    assert sub_batch_sizes(2) == [1]
    assert sub_batch_sizes(32) == [1, 2, 4, 8, 16]
    assert sub_batch_sizes(96, extra_divisors=2) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert sub_batch_sizes(7, extra_divisors=0) == [1, 2, 4]


# -- find's offers ------------------------------------------------------------------------------

P = ConvProblem("fwd", n=4, c=4, k=6, input_size=(7, 7), kernel_size=3, padding=1)
LIMIT = 2500  # the fast fake needs 1000 bytes a sample: 2 samples fit, 4 do not


def by_name(results):
    return {r.algorithm: r for r in results}


@pytest.mark.parametrize("direction", ["fwd", "bwd_filter"])
def test_find_offers_a_split_when_only_a_split_fits(direction):
    p = P.replace(direction=direction)
    fast, slow = Growing("fake:fast"), Fake("fake:slow", time_ms=5.0)
    limit = LIMIT + (aligned(6 * 4 * 9 * 4) if direction == "bwd_filter" else 0)
    results = find(p, Policy(workspace_limit=limit, micro_batching=True), timer=FakeTimer(),
                   candidates=[fast, slow])
    named = by_name(results)
    assert named["fake:fast"].status is Status.OVER_WORKSPACE_LIMIT
    best = results[0]
    # 2 x 2 samples: 2 x 0.25 ms beats 4 x 1 (0.6 ms) and the slow whole batch (5 ms).
    assert best.algorithm == "mb:fake.fast_s2x2" and best.status is Status.OK
    assert best.time_ms == pytest.approx(0.5)  # timed by the timer: two runs of 0.05 + 2 x 0.1 ms
    assert best.workspace_bytes == aligned(2000) + limit - LIMIT <= limit
    assert best.rel_error is not None and best.rel_error <= tolerance(p, fast.notes(p))
    assert "micro-batched 2 x 2 samples" in best.message and "over_workspace_limit" in best.message
    assert named["fake:slow"].status is Status.OK


def test_find_offers_nothing_without_micro_batching_or_a_limit():
    for policy in (Policy(workspace_limit=LIMIT), Policy(micro_batching=True)):
        fast, slow = Growing("fake:fast"), Fake("fake:slow", time_ms=5.0)
        results = find(P, policy, timer=FakeTimer(), candidates=[fast, slow])
        assert not [r for r in results if r.algorithm.startswith("mb:")]
        assert set(fast.batches) <= {4}  # never ran on a sub-batch


def test_find_offers_no_split_slower_than_a_fitting_whole_batch():
    fast, quick = Growing("fake:fast"), Fake("fake:quick", time_ms=0.2)
    results = find(P, Policy(workspace_limit=100_000, micro_batching=True), timer=FakeTimer(),
                   candidates=[fast, quick])
    assert not [r for r in results if r.algorithm.startswith("mb:")]
    assert results[0].algorithm == "fake:quick"


def test_a_split_that_rescues_an_over_limit_algorithm_is_offered_even_when_slower():
    fast, quick = Growing("fake:fast"), Fake("fake:quick", time_ms=0.3)
    results = find(P, Policy(workspace_limit=LIMIT, micro_batching=True), timer=FakeTimer(),
                   candidates=[fast, quick])
    assert [r.algorithm for r in results[:2]] == ["fake:quick", "mb:fake.fast_s2x2"]
    assert results[1].status is Status.OK and results[1].time_ms == pytest.approx(0.5)


def test_a_split_is_verified_like_any_candidate():
    blind, slow = OffsetBlind("fake:blind"), Fake("fake:slow", time_ms=5.0)
    results = find(P, Policy(workspace_limit=LIMIT, micro_batching=True), timer=FakeTimer(),
                   candidates=[blind, slow])
    named = by_name(results)
    # Right on every sub-batch find (whole tensors), wrong on the second slice of a split.
    assert named["mb:fake.blind_s2x2"].status is Status.WRONG_RESULT
    assert named["mb:fake.blind_s2x2"].time_ms is None
    assert results[0].algorithm == "fake:slow"


def test_registry_candidates_and_the_database_round_trip():
    fast, slow = Growing("fake:fast"), Fake("fake:slow", time_ms=5.0)
    db = FakeDB()
    with isolated(fast, slow):
        results = find(P, Policy(workspace_limit=LIMIT, micro_batching=True), db=db, timer=FakeTimer(),
                       candidates=[fast, slow])
        stored = by_name(db.results(P))
        assert stored["mb:fake.fast_s2x2"].status is Status.OK
        assert {p.n for p, _ in db.stored.values()} == {1, 2, 4}  # the sub-batch finds are stored too
        again = get_algorithm(results[0].algorithm, P)
        inputs, ref = reference_case(P)
        assert rel_error(again.run(P, *inputs), ref) <= tolerance(P, again.notes(P))
    with isolated(fast, slow, builtins=False):  # no candidates given: the registry's, resolved by name
        results = find(P, Policy(workspace_limit=LIMIT, micro_batching=True), timer=FakeTimer())
        assert results[0].algorithm == "mb:fake.fast_s2x2" and results[0].status is Status.OK


def test_policy_micro_batching_must_be_a_bool():
    with pytest.raises(TypeError, match="micro_batching"):
        Policy(micro_batching="yes")


def test_a_stored_split_answers_only_a_policy_that_allows_splitting():
    from convtune import PerfResult, Policy
    from convtune.ranking import rank

    split = PerfResult("mb:gemm.im2col_s2x2", "ok", time_ms=1.0, workspace_bytes=10)
    whole = PerfResult("gemm:im2col", "ok", time_ms=2.0, workspace_bytes=20)
    assert [r.algorithm for r in rank([split, whole], Policy())] == ["gemm:im2col"]
    assert rank([split, whole], Policy(micro_batching=True))[0].algorithm == "mb:gemm.im2col_s2x2"
    with isolated(builtins=False):  # a registry without the micro-batching backend still knows what it declared
        assert [r.algorithm for r in rank([split, whole], Policy())] == ["gemm:im2col"]
    # what the algorithm declares decides, not its name: a plug-in that splits the batch under a name of its own
    plug = Fake("plug:halves")
    plug.splits_batch = True
    with isolated(plug):
        split = PerfResult("plug:halves", "ok", time_ms=1.0)
        assert [r.algorithm for r in rank([split, whole], Policy())] == ["gemm:im2col"]
        assert rank([split, whole], Policy(micro_batching=True))[0].algorithm == "plug:halves"


def test_a_micro_batched_candidate_given_to_find_always_comes_back_with_a_status():
    # It vanished from the results under a policy without micro-batching (the ranking of predictions
    # left it out), and nothing said why.
    import convtune as ct
    from convtune.algorithms.microbatch import MicroBatch

    problem = ct.ConvProblem("fwd", n=4, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
    split = MicroBatch("torch:native", [(2, 2)])
    plain = {r.algorithm: r for r in ct.find(problem, candidates=[split, get_algorithm("torch:native")])}
    assert plain[split.name].status is Status.SKIPPED and "micro_batching=True" in plain[split.name].message
    from convtune.settings import settings

    with settings.override(find_prune_factor=0):  # timed whatever its prediction
        allowed = {r.algorithm: r for r in ct.find(problem, ct.Policy(micro_batching=True, workspace_limit="1MiB"),
                                                   candidates=[split, get_algorithm("torch:native")])}
    assert allowed[split.name].status is Status.OK and allowed[split.name].time_ms is not None


def test_a_split_whose_sub_batches_start_where_the_inner_algorithm_cannot_take_them_is_unsupported():
    # an inner algorithm that assumes aligned operands (cuDNN's plans: 16 bytes) gets each sub-batch as a view
    # starting its first sample's bytes into the batch: a split that lands elsewhere says so instead of failing
    class Aligned(Fake):
        alignment = 16

    inner = Aligned("fake:aligned16")
    odd = ConvProblem("fwd", n=3, c=1, k=4, input_size=(5, 5), kernel_size=1)  # x: 100 bytes a sample
    support = MicroBatch(inner, [(1, 3)]).supports(odd)
    assert not support and "starts 4 bytes past an address aligned to the 16 bytes" in support.reason
    even = odd.replace(c=4)  # 400 bytes a sample of x, 400 of y
    assert MicroBatch(inner, [(1, 3)]).supports(even)
    assert MicroBatch(Fake("fake:any"), [(1, 3)]).supports(odd)  # no alignment assumed: any split
