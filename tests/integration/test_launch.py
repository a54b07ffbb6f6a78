"""`partrain launch` end to end: the run dir, metrics, logs, a falling loss, clean exits."""

import json
import shutil
from collections import Counter

import pytest
from omegaconf import OmegaConf

from tests.integration.conftest import (
    assert_no_abort,
    processes_mentioning,
    read_metrics,
)

REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "step_time_s"}


def test_quickstart_trains_and_writes_the_run_dir(cli, tmp_path):
    run_dir = tmp_path / "run"
    # 20 steps: the loss falls from 5.5 to about 2.8 (the README's full run: 1.7 at step 300).
    res = cli.run("launch", "train.max_steps=20", "train.eval_every=10", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr
    steps, evals = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(REQUIRED <= r.keys() for r in steps)
    assert steps[-1]["tokens"] == 20 * 16 * 256
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, "the loss did not fall"
    assert [r["step"] for r in evals] == [10, 20]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    # The frozen config is what `partrain show` resolves, with the batch triple filled in.
    frozen = OmegaConf.load(run_dir / "config.yaml")
    assert frozen.parallel.dp == 2 and frozen.train.micro_batches == 2
    shown = cli.run("show", "train.max_steps=20", "train.eval_every=10")
    assert shown.returncode == 0 and OmegaConf.create(shown.stdout) == frozen
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == ["rank-0.log", "rank-1.log"]
    assert "step     20" in (run_dir / "logs" / "rank-1.log").read_text()
    # Each rank (forked from the rank server, the default here) has its share of the cores, set
    # before the server imported torch: OpenMP reads OMP_NUM_THREADS once, as it loads.
    from partrain.launch.cluster import usable_cores

    share = max(1, usable_cores() // 2)
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"on cpu, {share} CPU thread(s)" in log, log[:2000]
    assert "run summary" in res.stdout and "Traceback" not in res.stderr
    assert_no_abort(run_dir, res.stdout, res.stderr)
    assert processes_mentioning(str(run_dir)) == []
    # What to do next, with this run dir filled in; and `partrain runs` reads it as done.
    said = [line for line in res.stdout.splitlines() if line.startswith("next: ")]
    assert [line.split("#")[0].split()[1:3] for line in said] == [
        ["partrain", "sample"], ["partrain", "export"], ["partrain", "launch"]], res.stdout
    assert all(str(run_dir) in line for line in said), said
    assert f"--resume {run_dir} train.max_steps=40" in said[2]
    listed = cli.run("runs", "--root", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    run, = json.loads(listed.stdout)
    assert (run["state"], run["step"], run["max_steps"], run["checkpoint"]) == ("done", 20, 20, 20)
    assert run["loss"] == steps[-1]["loss"]


@pytest.mark.parametrize("degrees, ranks", [
    (("parallel.dp=1",), 1),
    (("parallel.tp=2", "parallel.dp=1"), 2),
])
def test_degrees_on_the_command_line_set_the_processes(cli, tmp_path, degrees, ranks):
    """On CPU with nothing pinning launcher.nproc_per_node, the processes follow the degrees:
    no --nproc-per-node needed (the README's short commands)."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", *degrees, "train.max_steps=2", "train.eval_every=0",
                  "train.seq_len=64", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert f"{ranks} rank(s), {ranks} on this node" in " ".join(res.stdout.split())
    assert OmegaConf.load(run_dir / "config.yaml").launcher.nproc_per_node == ranks
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == \
        [f"rank-{r}.log" for r in range(ranks)]
    assert len(read_metrics(run_dir)[0]) == 2


def test_dry_run_starts_and_writes_nothing(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "--dry-run", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert "dry run" in res.stdout and "dp(2)" in res.stdout
    assert not run_dir.exists()


def test_bad_config_exits_2_and_writes_nothing(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=3", "--nproc-per-node", "2", "--run-dir", str(run_dir))
    assert res.returncode == 2
    assert "pp(1) * dp(3) * tp(1) = 3 != world size 2" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not run_dir.exists()


def test_existing_run_dir_is_refused(cli, tmp_path):
    (tmp_path / "config.yaml").write_text("name: old\n")
    res = cli.run("launch", "--run-dir", str(tmp_path))
    assert res.returncode == 2 and "already exists" in res.stderr
    assert (tmp_path / "config.yaml").read_text() == "name: old\n"


def test_two_launches_started_together_in_one_run_dir_train_once(cli, tmp_path):
    """The same command twice at once: the run dir's in-use check reads logs/state.json, which
    a launch writes only once its ranks' server runs and it has imported torch; in those seconds
    the second launch passed it too, and both trained in the run dir (each committing and pruning
    the other's checkpoints). Now each launch holds this host's lock on the run dir from its last
    check on: one trains, the other is refused at once, naming the first."""
    run_dir = tmp_path / "run"
    args = ("launch", "parallel.dp=1", "train.max_steps=4", "train.eval_every=0",
            "checkpoint.every=2", "--run-dir", str(run_dir))
    first, second = cli.start(*args), cli.start(*args)
    outputs = {proc.pid: proc.communicate(timeout=240) for proc in (first, second)}
    codes = {proc.pid: proc.returncode for proc in (first, second)}
    assert sorted(codes.values()) == [0, 2], {pid: (codes[pid], out[1][-2000:])
                                              for pid, out in outputs.items()}
    trained = next(pid for pid, code in codes.items() if code == 0)
    refused = next(pid for pid, code in codes.items() if code == 2)
    assert (f"{run_dir} is in use: a launch runs in it (pid {trained}, "
            in " ".join(outputs[refused][1].split())), outputs[refused][1]
    assert "Traceback" not in outputs[refused][1]
    steps, _ = read_metrics(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # one run's steps, once each


@pytest.mark.slow
def test_zero3_failure_ends_the_job(cli, tmp_path):
    """A rank failing under ZeRO-3 at 4 ranks ends the job with exit 1, nothing left running.
    (ZeRO's clean exit is checked by every ZeRO parity run, assert_no_abort.)"""
    short = ("parallel.dp=4", "parallel.zero_stage=3", "--nproc-per-node", "4",
             "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=64")
    run_dir = tmp_path / "failing"
    res = cli.run("launch", *short, "train.max_steps=1000", "--run-dir", str(run_dir),
                  env={"PARTRAIN_TEST_FAULT": "2:3"}, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "rank 2 failed" in res.stderr and "injected fault" in res.stderr
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow  # the quick pass keeps the quickstart's end-to-end run
def test_prepared_token_data_end_to_end(cli, tmp_path):
    """A BPE tokenizer trained here: `data prepare --tokenizer` on two worker processes, a launch
    on the token dir (which keeps a copy of the tokenizer), and a sample decoded with it."""
    from partrain.data.tokens import fingerprint
    from tests.unit.data.corpus import train_bpe

    train_bpe(tmp_path / "tokenizer.json")
    text = tmp_path / "corpus.jsonl"
    sentence = "the quick brown fox jumps over the lazy dog. "
    text.write_text("".join(json.dumps({"text": sentence * 20}) + "\n" for _ in range(300)))
    data_dir = tmp_path / "tokens"
    res = cli.run("data", "prepare", str(text), "--tokenizer", str(tmp_path), "--workers", "2",
                  "--out", str(data_dir))
    assert res.returncode == 0, res.stderr
    assert "model.vocab_size=384" in res.stdout and "MB/s" in res.stdout
    meta = json.loads((data_dir / "meta.json").read_text())
    assert (meta["tokenizer"], meta["dtype"], meta["vocab_size"]) == ("tokenizer.json", "uint16", 300)
    run_dir = tmp_path / "run"
    # data.path relative to where the launch is typed: the run dir freezes it absolute, so that
    # a resume typed in another directory (a requeued job's, another shell's) reads the same.
    res = cli.run("launch", "data=tokens", "data.path=tokens", "model.vocab_size=384",
                  "train.max_steps=30", "train.seq_len=64", "--run-dir", str(run_dir),
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    checkpoint = run_dir / "checkpoints" / "step-00000030"
    for config in (run_dir / "config.yaml", checkpoint / "config.yaml"):
        assert OmegaConf.load(config).data.path == str(data_dir)
    # The checkpoint records what the data holds; the same tokens moved elsewhere resume.
    assert json.loads((checkpoint / "meta.json").read_text())["data"] == [fingerprint(data_dir)]
    moved = shutil.move(data_dir, tmp_path / "moved")
    res = cli.run("launch", "--resume", str(run_dir), "train.max_steps=32", f"data.path={moved}")
    assert res.returncode == 0, res.stderr
    assert f"data.path {data_dir} -> {moved} (the same tokens)" in res.stdout
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == \
        (tmp_path / "tokenizer.json").read_bytes()
    steps, evals = read_metrics(run_dir)
    # A repeated sentence is easy: the loss must fall far below uniform (ln 300 = 5.7).
    assert steps[-1]["loss"] < 2.0 and evals[-1]["val_loss"] < 2.0
    res = cli.run("sample", str(run_dir), "--prompt", "the quick", "--temperature", "0",
                  "--max-new-tokens", "12")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("the quick brown fox"), res.stdout


def test_bad_data_dir_exits_2(cli, tmp_path):
    (tmp_path / "meta.json").write_text("{not json")
    res = cli.run("launch", "data=tokens", f"data.path={tmp_path}", "--run-dir",
                  str(tmp_path / "run"))
    assert res.returncode == 2 and "meta.json" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_trace_json_shows_every_rank_and_microbatch(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=1", "parallel.pp=2", "train.max_steps=3",
                  "train.eval_every=0", "train.trace=true", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "rank 0 (pp 0, dp 0, tp 0)", 1: "rank 1 (pp 1, dp 0, tp 0)"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # quickstart: 16 sequences, micro_batch_size 4, dp 1 -> 4 micro-batches per step.
    for rank in (0, 1):
        compute = Counter(e["name"] for e in spans if e["tid"] == rank and e["cat"] == "compute")
        assert all(compute[f"{op}0.{mb}"] == 3 for op in "FB" for mb in range(4)), compute
    comm = [e for e in spans if e["cat"] == "comm"]
    assert any("send_f" in e["name"] for e in comm if e["tid"] == 0)
    assert any("recv_f" in e["name"] for e in comm if e["tid"] == 1)

    # The first step's program (gloo): rank 1 posts the receive of micro-batch 1's activation
    # before its backward of micro-batch 0, so the transfer overlaps that compute; rank 0
    # releases its first send before its last backward, not at the end of the step.
    def first(rank, name, cat):
        return min((e["ts"] for e in spans if e["tid"] == rank and e["cat"] == cat
                    and name(e["name"])), default=None)
    assert first(1, lambda n: n.startswith("post") and "recv_f 0.1" in n, "comm") \
        < first(1, lambda n: n == "B0.0", "compute")
    assert first(0, lambda n: n.startswith("release") and "send_f 0.0" in n, "comm") \
        < first(0, lambda n: n == "B0.3", "compute")


@pytest.mark.slow
def test_profile_writes_each_ranks_trace_and_table(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", "train.max_steps=4", "train.eval_every=0",
                  "train.profile_start=2", "train.profile_steps=2", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        table = (run_dir / "profile" / f"rank-{rank}.txt").read_text()
        assert table.startswith("steps 2-3: ") and "aten::mm" in table, table[:2000]
        trace = json.loads((run_dir / "profile" / f"rank-{rank}.json").read_text())
        names = {e["name"] for e in trace["traceEvents"]}
        # Both steps' forward, DDP's all-reduce and the optimizer, named as torch names them.
        assert {"aten::mm", "gloo:all_reduce", "Optimizer.step#AdamW.step"} <= names
        steps = [e for e in trace["traceEvents"] if e["name"] == "Optimizer.step#AdamW.step"]
        assert len(steps) == 2
    assert "profiled steps 2-3" in (run_dir / "logs" / "rank-0.log").read_text()
    # A resume may move the window (it was refused: "it changes the math of the run") and turn
    # the trace on; what it writes goes beside the first start's files, not over them.
    first = (run_dir / "profile" / "rank-0.txt").read_text()
    res = cli.run("launch", "--resume", str(run_dir), "train.max_steps=6", "train.profile_start=5",
                  "train.profile_steps=2", "train.trace=true")
    assert res.returncode == 0, res.stderr
    assert (run_dir / "profile" / "rank-0.txt").read_text() == first
    for rank in (0, 1):
        table = (run_dir / "profile" / f"rank-{rank}.from-step-5.txt").read_text()
        assert table.startswith("steps 5-6: "), table[:2000]
    trace = json.loads((run_dir / "trace.from-step-5.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert not (run_dir / "trace.json").exists()


@pytest.mark.slow
def test_measured_memory_matches_the_plan(cli, tmp_path):
    """train.measure_memory writes every rank's tensor-accounted peak of step 2; `plan`'s memory
    model predicts it within 10% (scripts/bench_memory.py holds 17 layouts to the same). pp2 with
    1F1B and selective checkpointing: stages with different micro-batches in flight, pipeline
    sends, the loss on one stage only, the recomputation's transient."""
    layout = ("launcher.device=cpu", "parallel.dp=1", "parallel.pp=2", "train.micro_batch_size=4",
              "train.global_batch_size=16", "train.seq_len=128",
              "train.activation_checkpointing=selective")
    plan = cli.run("plan", *layout, "--json")
    assert plan.returncode == 0, plan.stderr
    predicted = {s["pp_rank"]: s["total"] for s in json.loads(plan.stdout)["memory_per_stage"]}
    run_dir = tmp_path / "run"
    res = cli.run("launch", *layout, "train.max_steps=2", "train.eval_every=0",
                  "train.measure_memory=true", "checkpoint.every=0", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    assert "memory_peak_bytes" not in steps[0]
    peaks = steps[1]["memory_peak_bytes"]
    assert len(peaks) == 2 and peaks[0] != peaks[1]
    for rank, peak in enumerate(peaks):
        assert abs(predicted[rank] / peak - 1) <= 0.10, (rank, predicted[rank], peak)


def test_a_launch_whose_output_pipe_closes_trains_on(cli, tmp_path):
    """`partrain launch | head -3`: rich ends a process whose output pipe closed (SystemExit(1)),
    which killed rank 0 mid-run (reported as its `sys.exit(1)`) and left the launcher's state
    `running`. Now the consoles go quiet and the run finishes; its record is in the run dir."""
    run_dir = tmp_path / "run"
    proc = cli.start("launch", "train.max_steps=12", "train.eval_every=0", "train.log_every=1",
                     "--run-dir", str(run_dir))
    for _ in range(3):  # what `head -3` reads, then it exits
        assert proc.stdout.readline(), proc.stderr.read()
    proc.stdout.close()
    proc.wait(timeout=240)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == list(range(1, 13))
    assert json.loads((run_dir / "logs" / "state.json").read_text())["state"] == "done"
