"""Pipeline schedules as data: for each pp rank, the ordered list of actions it performs in one
optimizer step. No processes and no torch here: `partrain plan`, the unit tests and the executor
in partrain.parallel.pipeline all read the same lists.

Stages and chunks. The model is cut into S = pp * v consecutive stages (v = pp_virtual_stages).
Stage s runs on pp rank s % pp as that rank's local chunk s // pp, so with v > 1 a rank holds v
non-adjacent pieces of the model (Megatron's interleaving) and the last stage's output wraps from
rank pp-1 back to rank 0.

Actions. F and B compute a micro-batch through a chunk; RECV_F/SEND_F move activations to the
next stage, RECV_B/SEND_B gradients to the previous one. `simulate` runs the lists with sends
that never wait and receives that block until their send; `build_program` turns them into what
the executor does (when to post, wait and release), and `simulate_program` checks that under
gloo's rules.
"""

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SIMULATED_MAX_ACTIONS = 1 << 16  # `plan` simulates schedules (peak activations) up to this size
COMPUTE = ("F", "B")


@dataclass(frozen=True)
class Action:
    op: str  # F, B, SEND_F, RECV_F, SEND_B, RECV_B
    chunk: int  # local chunk on this rank (0..v-1)
    mb: int  # micro-batch
    peer: int = -1  # pp rank at the other end of a send/recv

    def __str__(self) -> str:
        return f"{self.op}{self.chunk}.{self.mb}" + (f"->{self.peer}" if self.peer >= 0 else "")


def bubble_theory(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with equal micro-batch times and free communication:
    (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1)."""
    scale = v if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (scale * m + pp - 1)


def in_flight_rule(schedule: str, pp: int, m: int, v: int = 1) -> list[int]:
    """Per pp rank, the chunk-micro-batches whose activations are alive at the schedule's peak,
    by rule rather than by simulation (`plan` above SIMULATED_MAX_ACTIONS, and the layout
    search): GPipe all of them; 1F1B rank r's warmup of pp - r - 1 forwards and one more;
    interleaved, Megatron-LM's warmup, (pp - r - 1) * 2 + (v - 1) * pp forwards and one more (all
    of them when m == pp). Equal to the simulation's peak_in_flight (tests/unit/parallel/
    test_schedules.py); 1F1B's rule times v, used for interleaved before, was short by up to
    a third at rank 0 (11 against 8 at pp4 v2: `--search` ranked layouts that do not fit)."""
    if schedule == "gpipe":
        return [m * v] * pp
    if v == 1:
        return [min(pp - r, m) for r in range(pp)]
    if m == pp:
        return [m * v] * pp
    return [min((pp - r - 1) * 2 + (v - 1) * pp + 1, m * v) for r in range(pp)]


def _compute_order(schedule: str, pp: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """(op, local chunk, micro-batch) in the order this rank computes them."""
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(pp - rank - 1, m)
        order = [("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", 0, warmup + i), ("B", 0, i)]
        return order + [("B", 0, i) for i in range(m - warmup, m)]
    if schedule == "interleaved_1f1b":
        # Megatron-LM's interleaved 1F1B: micro-batches go through the chunks in groups of pp;
        # the k-th forward of this rank is chunk (k // pp) % v of micro-batch
        # (k // (pp * v)) * pp + k % pp, and backwards walk the chunks in reverse.
        total = m * v

        def forward(k):
            return ("F", (k // pp) % v, (k // (pp * v)) * pp + k % pp)

        def backward(k):
            return ("B", v - 1 - (k // pp) % v, (k // (pp * v)) * pp + k % pp)

        warmup = total if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        return order + [backward(k) for k in range(total - warmup, total)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def check_shape(schedule: str, pp: int, m: int, v: int) -> None:
    """The rules a (schedule, pp, m, v) must meet; ValueError names the broken one."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp={pp}, micro_batches={m}, virtual stages={v} must all be >= 1")
    if schedule == "interleaved_1f1b":
        if v < 2:
            raise ValueError("interleaved_1f1b needs pp_virtual_stages >= 2")
        if m % pp:
            raise ValueError(f"interleaved_1f1b needs micro_batches ({m}) divisible by pp ({pp})")
    elif v != 1:
        raise ValueError(f"{schedule} runs one chunk per rank; pp_virtual_stages={v} needs "
                         "interleaved_1f1b")


def build_schedule(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """For each pp rank, its actions for one step: compute with the sends and receives it needs."""
    check_shape(schedule, pp, m, v)
    last = pp * v - 1
    ranks = []
    for rank in range(pp):
        actions = []
        for op, chunk, mb in _compute_order(schedule, pp, m, v, rank):
            stage = chunk * pp + rank
            nxt, prev = (stage + 1) % pp, (stage - 1) % pp
            if op == "F":
                if stage > 0:
                    actions.append(Action("RECV_F", chunk, mb, prev))
                actions.append(Action("F", chunk, mb))
                if stage < last:
                    actions.append(Action("SEND_F", chunk, mb, nxt))
            else:
                if stage < last:
                    actions.append(Action("RECV_B", chunk, mb, nxt))
                actions.append(Action("B", chunk, mb))
                if stage > 0:
                    actions.append(Action("SEND_B", chunk, mb, prev))
        ranks.append(actions)
    return ranks


def message_key(action: Action, rank: int, pp: int) -> tuple[str, int, int]:
    """What a send carries or a receive waits for: (direction, receiving stage, micro-batch)."""
    stage = action.chunk * pp + rank
    if action.op == "SEND_F":
        return ("F", stage + 1, action.mb)
    if action.op == "RECV_F":
        return ("F", stage, action.mb)
    if action.op == "SEND_B":
        return ("B", stage - 1, action.mb)
    if action.op == "RECV_B":
        return ("B", stage, action.mb)
    raise ValueError(f"{action} is not a send or receive")


@dataclass
class Simulation:
    spans: list[list[tuple[Action, float, float]]]  # per rank: compute action, start, end
    makespan: float
    peak_in_flight: list[int]  # per rank: most micro-batch chunks forwarded and not yet backwarded

    def bubble(self) -> float:
        """Mean idle fraction over ranks."""
        busy = [sum(end - start for _, start, end in spans) for spans in self.spans]
        return sum(1 - b / self.makespan for b in busy) / len(busy)


def _round_robin(lists: list[list], advance) -> None:
    """Move every rank along its list, in turn, as far as `advance(rank, item)` lets it (False:
    the item blocks for now); RuntimeError naming what each rank waits on when none can move."""
    pos = [0] * len(lists)
    while any(pos[r] < len(items) for r, items in enumerate(lists)):
        progressed = False
        for r, items in enumerate(lists):
            while pos[r] < len(items) and advance(r, items[pos[r]]):
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(items[pos[r]]) for r, items in enumerate(lists) if pos[r] < len(items)}
            raise RuntimeError(f"deadlock: ranks wait on {stuck}")


def simulate(ranks: list[list[Action]], f_time: float = 1.0, b_time: float = 2.0,
             durations=None) -> Simulation:
    """Run the lists with free communication: sends never wait, receives block until the
    matching send happened. Compute takes f_time / b_time, or `durations(rank, action)` (a
    measured step replayed: scripts/bench_pp.py). Raises RuntimeError on a deadlock or an
    unmatched message."""
    pp = len(ranks)
    now = [0.0] * pp
    sent: dict[tuple, float] = {}
    received: set = set()
    spans = [[] for _ in range(pp)]
    in_flight, peak = [0] * pp, [0] * pp

    def advance(r: int, action: Action) -> bool:
        if action.op.startswith("SEND"):
            key = message_key(action, r, pp)
            if key in sent:
                raise RuntimeError(f"rank {r}: {action} sends {key} twice")
            sent[key] = now[r]
        elif action.op.startswith("RECV"):
            key = message_key(action, r, pp)
            if key not in sent:
                return False
            received.add(key)
            now[r] = max(now[r], sent[key])
        else:
            duration = (durations(r, action) if durations
                        else f_time if action.op == "F" else b_time)
            spans[r].append((action, now[r], now[r] + duration))
            now[r] += duration
            in_flight[r] += 1 if action.op == "F" else -1
            peak[r] = max(peak[r], in_flight[r])
        return True

    _round_robin(ranks, advance)
    unmatched = set(sent) - received
    if unmatched:
        raise RuntimeError(f"sent but never received: {sorted(unmatched)[:5]}")
    return Simulation(spans, max(now), peak)


# Programs: how the executor runs a rank's actions. A receive is posted before the compute that
# precedes the one needing it (`early`: gloo), so its transfer overlaps that compute, and waited
# on just before it is needed; each run of sends is posted right after the compute that made it.
# A send is released (waited on, its buffer dropped) once a later receive from the same peer
# proves that the peer has posted the matching receive: gloo moves a message only after its
# receive is posted, and the peer's notice of that receive travels on the same connection ahead
# of the message we waited for, so the wait is short. Sends with no such receive end the step.
POST, WAIT, RELEASE, COMPUTE_STEP = "post", "wait", "release", "compute"


@dataclass(frozen=True)
class Step:
    kind: str  # post, wait, release, compute
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return f"{self.kind}({' '.join(map(str, self.actions))})"


def _rank_program(actions: list[Action], early: bool) -> list[Step]:
    runs, computes = [[]], []
    for a in actions:
        if a.op in COMPUTE:
            computes.append(a)
            runs.append([])
        else:
            runs[-1].append(a)
    posts = [list(run) for run in runs]
    waits = [[a for a in run if a.op.startswith("RECV")] for run in runs]
    if early:  # run k precedes compute k: its receives go to run k-1, before compute k-1
        for k in range(1, len(computes)):
            posts[k - 1] += waits[k]
            posts[k] = [a for a in runs[k] if not a.op.startswith("RECV")]
    steps = []
    for k, run in enumerate(posts):
        if run:
            steps.append(Step(POST, tuple(run)))
        if waits[k]:
            steps.append(Step(WAIT, tuple(waits[k])))
        if k < len(computes):
            steps.append(Step(COMPUTE_STEP, (computes[k],)))
    return steps


def build_program(ranks: list[list[Action]], early: bool = True) -> list[list[Step]]:
    """Every rank's program for the action lists of `build_schedule` (or their forward-only
    subset), with the releases of its sends; the last step releases what is left."""
    pp = len(ranks)
    programs = [_rank_program(actions, early) for actions in ranks]
    posted = []  # per rank: message key -> index of the step that posts it
    for r, program in enumerate(programs):
        posted.append({(a.op[:4], message_key(a, r, pp)): i
                       for i, step in enumerate(program) if step.kind == POST
                       for a in step.actions})
    out = []
    for r, program in enumerate(programs):
        pending, releases = [], {}  # sends not yet released; wait index -> sends it releases
        for i, step in enumerate(program):
            if step.kind == POST:
                pending += [a for a in step.actions if a.op.startswith("SEND")]
            elif step.kind == WAIT:
                for recv in step.actions:
                    # The peer posted this message's send after these sends' receives.
                    sent_at = posted[recv.peer][("SEND", message_key(recv, r, pp))]
                    done = [s for s in pending if s.peer == recv.peer
                            and posted[s.peer][("RECV", message_key(s, r, pp))] < sent_at]
                    releases.setdefault(i, []).extend(done)
                    pending = [s for s in pending if s not in done]
        steps = []
        for i, step in enumerate(program):
            steps.append(step)
            if releases.get(i):
                steps.append(Step(RELEASE, tuple(releases[i])))
        if pending:
            steps.append(Step(RELEASE, tuple(pending)))
        out.append(steps)
    return out


@dataclass
class ProgramRun:
    makespan: float
    peak_buffers: list[int]  # per rank: most sends unreleased plus receives posted, not waited


def simulate_program(programs: list[list[Step]], f_time: float = 1.0,
                     b_time: float = 2.0) -> ProgramRun:
    """Run programs under gloo's rules: posting never blocks; a wait blocks until the peer has
    posted the matching send, a release until it has posted the matching receive. Raises
    RuntimeError on a deadlock or on a message not waited for or not released once."""
    pp = len(programs)
    now = [0.0] * pp
    posted: dict[tuple, float] = {}
    buffers, peak = [0] * pp, [0] * pp
    waited: Counter = Counter()

    def advance(r: int, step: Step) -> bool:
        keys = [message_key(a, r, pp) for a in step.actions if a.op not in COMPUTE]
        if step.kind == POST:
            for a, key in zip(step.actions, keys):
                if (a.op[:4], key) in posted:
                    raise RuntimeError(f"rank {r}: {a} posts {key} twice")
                posted[(a.op[:4], key)] = now[r]
            buffers[r] += len(step.actions)
        elif step.kind in (WAIT, RELEASE):
            other = "SEND" if step.kind == WAIT else "RECV"
            if any((other, key) not in posted for key in keys):
                return False
            now[r] = max([now[r]] + [posted[(other, key)] for key in keys])
            waited.update((step.kind, key) for key in keys)
            buffers[r] -= len(step.actions)
        else:
            now[r] += f_time if step.actions[0].op == "F" else b_time
        peak[r] = max(peak[r], buffers[r])
        return True

    _round_robin(programs, advance)
    sends = {key for (kind, key) in posted if kind == "SEND"}
    for kind in (WAIT, RELEASE):
        done = {key for (k, key) in waited if k == kind}
        if done != sends or any(n != 1 for (k, _), n in waited.items() if k == kind):
            raise RuntimeError(f"not every message {'received' if kind == WAIT else 'released'} "
                               "exactly once")
    return ProgramRun(max(now), peak)


@lru_cache(maxsize=4096)
def peak_buffers(schedule: str, pp: int, m: int, v: int = 1, early: bool = True) -> tuple[int, ...]:
    """Per rank, the most activation-sized p2p buffers its program holds at once (sends not yet
    released, receives posted and not yet waited for). 1F1B's and interleaved's stop growing
    at 2 x pp micro-batches and GPipe's grow by one per micro-batch (tests hold both), so a
    large m is simulated at 2 x pp and extrapolated."""
    small = min(m, 2 * pp)
    run = simulate_program(build_program(build_schedule(schedule, pp, small, v), early))
    grow = m - small if schedule == "gpipe" else 0
    return tuple(n + grow for n in run.peak_buffers)
