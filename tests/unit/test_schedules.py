"""Pipeline schedules as data (partrain.parallel.schedules), checked without processes: every
micro-batch forwarded and backwarded once per chunk, sends match receives, the lists run to the
end under the executor's rules (simulation), peak in-flight activations, bubble vs theory."""

from collections import Counter

import pytest

from partrain.parallel.schedules import (bubble_theory, build_schedule, check_shape,
                                         message_key, simulate)

GRID = [(s, p, m, v)
        for s, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved_1f1b", [2, 3]))
        for v in vs
        for p in (2, 3, 4)
        for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 4 * p, 3 * p - 1})
        if not (s == "interleaved_1f1b" and m % p)]


def _ids(case):
    return "{}-p{}-m{}-v{}".format(*case)


@pytest.mark.parametrize("case", GRID, ids=[_ids(c) for c in GRID])
def test_every_microbatch_once_per_chunk(case):
    schedule, p, m, v = case
    ranks = build_schedule(schedule, p, m, v)
    for rank, actions in enumerate(ranks):
        for op in ("F", "B"):
            done = Counter((a.chunk, a.mb) for a in actions if a.op == op)
            assert done == Counter({(c, i): 1 for c in range(v) for i in range(m)}), (rank, op)
        # A chunk's backward of a micro-batch comes after its forward.
        order = {(a.op, a.chunk, a.mb): n for n, a in enumerate(actions) if a.op in ("F", "B")}
        assert all(order[("B", c, i)] > order[("F", c, i)] for c in range(v) for i in range(m))


@pytest.mark.parametrize("case", GRID, ids=[_ids(c) for c in GRID])
def test_sends_match_receives_in_order(case):
    schedule, p, m, v = case
    ranks = build_schedule(schedule, p, m, v)
    for a in range(p):
        for b in range(p):
            sends = [message_key(x, a, p) for x in ranks[a] if x.op.startswith("SEND") and x.peer == b]
            recvs = [message_key(x, b, p) for x in ranks[b] if x.op.startswith("RECV") and x.peer == a]
            # Same messages, and in the same order (NCCL matches point-to-point in order).
            assert sends == recvs, (a, b)
    stages = p * v
    total = sum(1 for actions in ranks for x in actions if x.op.startswith("SEND"))
    assert total == 2 * (stages - 1) * m  # activations forward and gradients back, per boundary


@pytest.mark.parametrize("case", GRID, ids=[_ids(c) for c in GRID])
def test_simulation_finishes_and_bubble_is_theory(case):
    schedule, p, m, v = case
    sim = simulate(build_schedule(schedule, p, m, v))
    assert sim.bubble() == pytest.approx(bubble_theory(schedule, p, m, v), abs=1e-9)
    if schedule == "gpipe":
        assert sim.peak_in_flight == [m] * p
    elif schedule == "1f1b":
        assert max(sim.peak_in_flight) <= p
        assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]
    else:
        assert max(sim.peak_in_flight) <= v * m


@pytest.mark.parametrize("case", GRID, ids=[_ids(c) for c in GRID])
def test_forward_only_subset_finishes(case):
    # Evaluation runs the forward actions alone.
    schedule, p, m, v = case
    ranks = [[a for a in actions if a.op in ("F", "SEND_F", "RECV_F")]
             for actions in build_schedule(schedule, p, m, v)]
    sim = simulate(ranks)
    assert all(len(spans) == m * v for spans in sim.spans)


def test_1f1b_beats_gpipe_on_memory_not_bubble():
    gpipe, one = (simulate(build_schedule(s, 4, 16)) for s in ("gpipe", "1f1b"))
    assert gpipe.makespan == one.makespan
    assert max(one.peak_in_flight) == 4 < max(gpipe.peak_in_flight) == 16


def test_interleaving_shrinks_the_bubble():
    plain = simulate(build_schedule("1f1b", 4, 8)).bubble()
    inter = simulate(build_schedule("interleaved_1f1b", 4, 8, 2)).bubble()
    assert inter == pytest.approx(3 / 19) and plain == pytest.approx(3 / 11)


def test_simulation_detects_a_deadlock():
    ranks = build_schedule("1f1b", 2, 2)
    # Rank 0 waiting for a gradient before it sends the activation that would produce it.
    first = next(a for a in ranks[0] if a.op == "RECV_B")
    early = [first] + [a for a in ranks[0] if a != first]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([early, ranks[1]])
    # Rank 0 never receiving its last gradient: a message left unmatched.
    dropped = [a for a in ranks[0] if not (a.op == "RECV_B" and a.mb == 1)]
    with pytest.raises(RuntimeError, match="never received"):
        simulate([dropped, ranks[1]])


@pytest.mark.parametrize("args, message", [
    (("interleaved_1f1b", 2, 3, 2), "divisible by pp"),
    (("interleaved_1f1b", 2, 4, 1), "pp_virtual_stages >= 2"),
    (("1f1b", 2, 4, 2), "needs interleaved_1f1b"),
    (("zb", 2, 4, 1), "unknown pipeline schedule"),
])
def test_shape_rules(args, message):
    with pytest.raises(ValueError, match=message):
        check_shape(*args)
