"""Cluster environments read from environment variables (no cluster needed), SLURM node lists,
the rendezvous port of a job, the network interface choice, and the run-dir join rule; through
the CLI where a user would meet them (exit 2, one message, nothing started)."""

import os
import socket

import pytest
from omegaconf import OmegaConf

from partrain.errors import ConfigError
from partrain.launch.cluster import (
    SlurmEnvironment,
    TorchElasticEnvironment,
    detect_place,
    expand_nodelist,
    slurm_port,
)
from partrain.launch.netif import (
    interface_of,
    pick_network,
    route_to,
    set_ifname_variables,
    split_endpoint,
    wait_for_endpoint,
)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node7", ["node7"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2],b[05,10-11],c", ["a1", "a2", "b05", "b10", "b11", "c"]),
    ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
    ("gpu-[3]-ib", ["gpu-3-ib"]),
])
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, fragment", [
    ("gpu[01-04", "'[' without ']'"),
    ("gpu01]", "']' without '['"),
    ("gpu[4-1]", "range 4-1 runs backwards"),
    ("gpu[a-b]", "'a-b' is not a number or a range"),
    ("", "names no node"),
])
def test_bad_nodelist_names_it(nodelist, fragment):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST") as info:
        expand_nodelist(nodelist)
    assert fragment in str(info.value)


def test_port_from_job_id_is_stable_and_in_range():
    assert slurm_port("123456") == 29500 + 456
    assert slurm_port("999") == 30499
    assert slurm_port("1000") == 29500
    assert slurm_port("123456") == slurm_port("123456")


SLURM_TASK = {  # what srun sets for task 1 of `srun -N 4 --ntasks-per-node=1` in job 4711
    "SLURM_JOB_ID": "4711", "SLURM_NNODES": "4", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[01-02,07],cpu3", "SLURM_NTASKS": "4", "SLURM_GPUS_ON_NODE": "8",
    "SLURM_TASKS_PER_NODE": "1(x4)",
}


def test_slurm_task_gives_the_node_its_place():
    assert SlurmEnvironment.detect(SLURM_TASK)
    place = detect_place(None, SLURM_TASK)
    assert (place.nnodes, place.node_rank, place.job_id, place.gpus_on_node) == (4, 1, "4711", 8)
    assert place.rdzv_endpoint == "gpu01:30211"  # the head node, port from the job id
    assert place.source == "SLURM job 4711"


def test_slurm_step_variables_win_over_the_job_ones():
    env = {**SLURM_TASK, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[02,07]",
           "SLURM_STEP_NUM_TASKS": "2"}
    place = detect_place(None, env)
    assert (place.nnodes, place.rdzv_endpoint) == (2, "gpu02:30211")


@pytest.mark.parametrize("missing", ["SLURM_JOB_ID", "SLURM_NODEID", "SLURM_STEP_ID"])
def test_outside_an_srun_task_slurm_is_not_detected(missing):
    # The batch script itself and an salloc shell have no SLURM_STEP_ID: flags decide there.
    env = {k: v for k, v in SLURM_TASK.items() if k != missing}
    assert not SlurmEnvironment.detect(env)
    assert detect_place(None, env).nnodes is None


@pytest.mark.parametrize("extra", [
    {"SLURM_NTASKS": "32"},  # srun -N 4 -n 32
    {"SLURM_NTASKS_PER_NODE": "8"},
    {"SLURM_TASKS_PER_NODE": "8(x4)", "SLURM_NTASKS": "32"},
    {"SLURM_STEP_TASKS_PER_NODE": "8(x4)"},
])
def test_one_srun_task_per_gpu_is_a_double_launch(extra):
    env = {**SLURM_TASK, **extra}
    with pytest.raises(ConfigError) as info:
        detect_place(8, env)
    message = str(info.value)
    assert "SLURM runs 8 tasks of `partrain launch` per node" in message
    assert "each would start 8 workers itself: a double launch" in message
    assert "--ntasks-per-node=1" in message


def test_under_torchrun_launch_is_refused_with_the_command_to_use():
    env = {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "3", "WORLD_SIZE": "8", **SLURM_TASK}
    assert TorchElasticEnvironment.detect(env)
    with pytest.raises(ConfigError, match="started by torchrun") as info:
        detect_place(None, env)  # torchrun inside srun: torchrun is named, it comes first
    assert "TORCHELASTIC_RUN_ID=abc, LOCAL_RANK=3" in str(info.value)
    assert "--rdzv-endpoint HOST:PORT" in str(info.value)


def test_plain_machine_has_no_place():
    place = detect_place(None, {"PATH": "/usr/bin"})
    assert (place.nnodes, place.node_rank, place.rdzv_endpoint, place.source) == \
        (None, None, None, "this machine")


@pytest.mark.parametrize("endpoint, expected", [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)), ("head:1", ("head", 1)),
    ("[fd00::1]:29400", ("fd00::1", 29400)),
])
def test_split_endpoint(endpoint, expected):
    assert split_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["head", "head:", ":29400", "head:port", "head:70000"])
def test_bad_endpoint_names_the_flag(endpoint):
    with pytest.raises(ConfigError, match=f"--rdzv-endpoint {endpoint} must be HOST:PORT"):
        split_endpoint(endpoint)


def test_route_to_loopback_is_lo():
    network = pick_network("127.0.0.1:29400", None, None)
    assert (network.ifname, network.addr) == ("lo", "127.0.0.1")
    assert network.how == "the route to 127.0.0.1:29400"
    assert interface_of("127.0.0.1") == "lo"


@pytest.mark.parametrize("others, expect", [
    ([("eth0", "10.1.0.1")], ("eth0", "10.1.0.1")),
    ([("eth0", "10.1.0.1"), ("ib0", "10.2.0.1")], "give --ifname, one of eth0, ib0"),
    ([], "no other interface with an IPv4 address; give --local-addr"),
])
def test_node_0_whose_own_name_is_loopback_offers_its_other_interface(monkeypatch, others,
                                                                      expect):
    """The endpoint names node 0 itself, whose /etc/hosts maps its own name to 127.0.1.1
    (Debian's default): the kernel's route to it is loopback, and node 0 offered 127.0.0.1 and
    pinned gloo and NCCL to lo, which the other nodes cannot reach (a warning, then a failed or
    hung first collective). The kernel's route and this node's interfaces are stand-ins: the
    test machine's /etc/hosts is not the case's."""
    from partrain.launch import netif

    monkeypatch.setattr(netif, "route_to", lambda host, port, source: "127.0.1.1")
    monkeypatch.setattr(netif, "non_loopback_ipv4", lambda: others)
    if isinstance(expect, tuple):
        network = pick_network("node0:29500", None, None)
        assert (network.ifname, network.addr) == expect
        assert "is this node, whose own route to it is loopback (127.0.1.1)" in network.how
        assert netif.network_warnings(network, "node0:29500") == []
    else:
        with pytest.raises(ConfigError) as e:
            pick_network("node0:29500", None, None)
        assert "--rdzv-endpoint node0:29500 is this node" in str(e.value)
        assert expect in str(e.value)


def test_given_interface_and_address_win():
    assert pick_network("10.9.9.9:1", None, "lo").addr == "127.0.0.1"
    assert pick_network("10.9.9.9:1", "127.0.0.1", None).ifname == "lo"
    with pytest.raises(ConfigError, match="--ifname nosuch0: no such interface on this node"):
        pick_network("127.0.0.1:1", None, "nosuch0")


def test_unresolvable_endpoint_is_a_config_error():
    with pytest.raises(ConfigError, match="--rdzv-endpoint no-such-host.invalid:29400: the host "
                                          "does not resolve"):
        route_to("no-such-host.invalid", 29400)


def test_ifname_variables_set_unless_the_user_set_them():
    network = pick_network("127.0.0.1:29400", None, None)
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    lines = set_ifname_variables(network, env)
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}
    assert lines == ["GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME=ib0 (already set, kept)"]


def test_wait_for_endpoint_gives_up_with_the_reason():
    with socket.socket() as s:  # a port that nobody listens on: bound, not listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert wait_for_endpoint("127.0.0.1", port, 0.5) == "Connection refused"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert wait_for_endpoint("127.0.0.1", server.getsockname()[1], 5) is None


# Through the CLI, in-process: exit 2, the message on stderr, nothing started or written.
def test_launch_under_torchrun_exits_2(run_main, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "xyz")
    result = run_main("launch", "--run-dir", str(tmp_path / "run"))
    assert result.code == 2 and "started by torchrun" in result.stderr
    assert not (tmp_path / "run").exists()


def test_launch_double_launch_in_slurm_exits_2(run_main, monkeypatch, tmp_path):
    for key, value in {**SLURM_TASK, "SLURM_NTASKS": "8", "SLURM_NNODES": "1"}.items():
        monkeypatch.setenv(key, value)
    result = run_main("launch", "--run-dir", str(tmp_path / "run"))
    assert result.code == 2 and "double launch" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_launch_in_slurm_takes_the_job_place(run_main, monkeypatch):
    for key, value in {**SLURM_TASK, "SLURM_JOB_NODELIST": "localhost,n2", "SLURM_NNODES": "2",
                       "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    result = run_main("launch", "parallel.dp=4", "--dry-run")
    assert result.code == 0, result.stderr
    assert "would write runs/quickstart-job4711" in result.stdout  # same dir on every node
    assert "network: 127.0.0.1 on lo (the route to localhost:30211)" in result.stdout


def test_node_0_refuses_an_endpoint_port_another_process_listens_on(run_main, tmp_path):
    """It failed after the start (a run dir left behind) with EADDRINUSE and a hint to look at
    the other nodes; node 1, which only connects there, is not asked."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = ("launch", "--nnodes", "2", "parallel.dp=4", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--dry-run", "--run-dir", str(tmp_path / "run"))
        result = run_main(*args)
        assert result.code == 2, result.stderr
        assert (f"port {port} cannot be listened on on this node (Address already in use)"
                in " ".join(result.stderr.split()))
        assert run_main(*args, "--node-rank", "1").code == 0
    assert run_main(*args).code == 0
    assert not (tmp_path / "run").exists()


def test_launch_rejects_unreachable_endpoint_host(run_main):
    result = run_main("launch", "--nnodes", "2", "parallel.dp=4", "--rdzv-endpoint",
                      "no-such-host.invalid:29400", "--dry-run")
    assert result.code == 2 and "the host does not resolve" in result.stderr


def test_frozen_config_runs_as_is_and_refuses_overrides(run_main, tmp_path):
    from partrain.launch.rundir import check_run_dir, write_run_dir
    from tests.unit.helpers import resolved

    cfg, _, _ = resolved("train.max_steps=7")
    run_dir = write_run_dir(cfg, tmp_path / "run")
    frozen = str(run_dir / "config.yaml")
    result = run_main("launch", frozen, "--run-dir", str(run_dir), "--dry-run")
    assert result.code == 0, result.stderr  # the run dir holds this very config: joined
    result = run_main("launch", frozen, "train.max_steps=8", "--dry-run")
    assert result.code == 2 and "frozen config and takes no overrides" in result.stderr
    # Another config is refused, saying how it differs (two nodes given other overrides).
    other, _, _ = resolved("train.max_steps=8")
    with pytest.raises(ConfigError, match=r"holds another config \(train.max_steps: 7 there, 8 "
                                          r"here\): every node of a run runs the same config"):
        check_run_dir(run_dir, other)
    # A run dir this config trained in without a checkpoint is joined (the run starts again);
    # one that holds anything else is not partrain's to write into.
    (run_dir / "metrics.jsonl").write_text("{}\n")
    check_run_dir(run_dir, cfg)
    with pytest.raises(ConfigError, match="holds another config"):
        check_run_dir(run_dir, other)
    (run_dir / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        check_run_dir(run_dir, cfg)


def test_the_config_is_put_only_where_none_is_or_the_same(tmp_path):
    """Two nodes started at once with other configs both pass check_run_dir before either
    writes: the first config.yaml in place stays (a hard link fails where one is), and the
    other node is refused, naming how the two differ. A resume replaces it."""
    from partrain.launch.rundir import _put_config
    from tests.unit.helpers import resolved

    ten, _, _ = resolved("train.max_steps=10")
    twenty, _, _ = resolved("train.max_steps=20")
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def put(cfg, resuming=False):
        tmp = run_dir / ".config.yaml.1.tmp"
        tmp.write_text(OmegaConf.to_yaml(cfg))
        _put_config(tmp, run_dir, cfg, resuming)
        assert not tmp.exists()

    put(ten)
    put(ten)  # the other node, the same config
    with pytest.raises(ConfigError, match=r"holds another config \(train.max_steps: 10 there, 20 "
                                          r"here\)"):
        put(twenty)
    assert OmegaConf.load(run_dir / "config.yaml").train.max_steps == 10
    put(twenty, resuming=True)
    assert OmegaConf.load(run_dir / "config.yaml").train.max_steps == 20


def test_slurm_on_a_run_dir_with_a_checkpoint_says_how_to_continue_it(tmp_path):
    from partrain.launch.rundir import check_run_dir
    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 8)
    with pytest.raises(ConfigError) as e:
        check_run_dir(run_dir, None)
    assert str(e.value) == (f"--run-dir {run_dir} holds a run with a checkpoint at step 8; "
                            f"continue it with `partrain slurm --resume {run_dir} --nodes N`; "
                            "or give a new --run-dir for a new run")
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n")
    with pytest.raises(ConfigError) as e:
        check_run_dir(run_dir, None)
    assert (f"resubmit its script to continue it: sbatch {run_dir / 'job.sbatch'}; on other "
            f"nodes: `partrain slurm --resume {run_dir} --nodes N`; or give a new --run-dir"
            ) in str(e.value)


def test_a_head_node_whose_name_does_not_resolve_is_reached_at_its_node_addr(
        run_main, monkeypatch, tmp_path):
    """`srun partrain launch` at a site whose NodeName is no host name (SLURM's NodeAddr holds
    the address): the endpoint is the head node's NodeAddr, as `scontrol show node` gives it
    (what the script of `partrain slurm` asks too). MOCKED: `scontrol` is a script on PATH
    standing in for a cluster's controller, which the unit tests do not run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$4" = "nohost-n1" ] && echo "NodeName=nohost-n1 Arch=x86_64 '
        'CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=nohost-n1 State=IDLE"\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {**SLURM_TASK, "SLURM_JOB_NODELIST": "nohost-n[1-2]", "SLURM_NNODES": "2",
                       "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    result = run_main("launch", "parallel.dp=4", "--dry-run")
    assert result.code == 0, result.stderr
    assert "network: 127.0.0.1 on lo (the route to 127.0.0.1:30211)" in result.stdout, result.stdout
    # A name scontrol does not know stays, and is refused as before, naming it.
    monkeypatch.setenv("SLURM_JOB_NODELIST", "nohost-m[1-2]")
    result = run_main("launch", "parallel.dp=4", "--dry-run")
    assert result.code == 2 and "nohost-m1:30211: the host does not resolve" in result.stderr


@pytest.mark.parametrize("flags, warned", [
    (["--ifname", "lo"], "this node offers 127.0.0.1 (given by --ifname, its address "
                         "127.0.0.1), a loopback address the other nodes cannot reach"),
    (["--local-addr", "10.9.9.9"], "--local-addr 10.9.9.9 is on no interface of this node"),
    (["--ifname", "lo", "--local-addr", "127.0.0.1"], "a loopback address"),
])
def test_network_flags_the_other_nodes_cannot_reach_are_warned_of(run_main, flags, warned):
    """The newcomer's finding: these went through without a word. Warned, not refused: two
    nodes on one machine share loopback, and a NAT's address is on no interface."""
    result = run_main("launch", "--nnodes", "2", "parallel.dp=4", "--rdzv-endpoint",
                      "10.1.0.1:29400", *flags, "--dry-run")
    assert result.code == 0, result.stderr
    assert warned in " ".join(result.stderr.split()), result.stderr
    on_one_machine = run_main("launch", "--nnodes", "2", "parallel.dp=4", "--rdzv-endpoint",
                              "127.0.0.1:29400", "--ifname", "lo", "--dry-run")
    assert "loopback" not in on_one_machine.stderr, on_one_machine.stderr


@pytest.mark.parametrize("state, code, last_step", [
    ("done", 0, 1), ("failed", 1, 1), ("interrupted", 130, 1), ("running", None, 1),
    ("running-live", None, 1), ("failed", 1, 300), (None, None, 300), (None, None, 1)])
def test_a_run_dir_without_a_checkpoint_is_started_again_unless_its_run_finished(
        tmp_path, state, code, last_step):
    """Stopped before its first checkpoint (failed, interrupted, or a launch that died without
    recording its end: a requeued job's): the same config starts again. A run that finished
    without keeping a checkpoint (said done, or its metrics at max_steps) has its metrics as
    its result, and a launch still running in it (alive, on this host) its own: neither is
    written over."""
    import json
    import subprocess
    import sys

    from partrain.launch.rundir import check_not_in_use, check_run_dir, write_run_dir
    from partrain.launch.runs import STATE_FILE, _start_ticks, write_state
    from tests.unit.helpers import resolved

    cfg, _, _ = resolved("checkpoint.every=0", "checkpoint.save_last=false")  # 300 steps
    run_dir = write_run_dir(cfg, tmp_path / "run")
    (run_dir / "metrics.jsonl").write_text(f'{{"step": {last_step}, "loss": 5.5}}\n')
    if state is not None:
        write_state(run_dir, state.removesuffix("-live"), code)
    other = None
    if state == "running-live":  # another launch on this host, alive
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        record = json.loads((run_dir / STATE_FILE).read_text())
        (run_dir / STATE_FILE).write_text(json.dumps(
            {**record, "pid": other.pid, "started": _start_ticks(other.pid)}))
    try:
        if state == "running-live":
            assert check_run_dir(run_dir, cfg) is None  # and preflight's next check refuses
            with pytest.raises(ConfigError, match=f"is in use: a launch runs in it "
                                                  f"\\(pid {other.pid}"):
                check_not_in_use(run_dir, 1, resuming=False)
        elif state == "done" or last_step == 300:
            with pytest.raises(ConfigError, match="holds a finished run of this very config "
                                                  "that kept no checkpoint"):
                check_run_dir(run_dir, cfg)
        else:
            assert check_run_dir(run_dir, cfg) is None
    finally:
        if other is not None:
            other.kill()
            other.wait()


@pytest.mark.parametrize("state", ["interrupted", "running", None])
def test_a_run_that_lost_its_final_save_starts_again(tmp_path, state):
    """Its metrics reached max_steps, and its config saves at the end (save_last), but there is
    no checkpoint: a Ctrl-C (or a kill) during that save. Nothing was kept, as the interrupt
    said, and the same command starts the run again; it was refused as a finished run that
    keeps no checkpoint."""
    from partrain.launch.rundir import check_run_dir, write_run_dir
    from partrain.launch.runs import write_state
    from tests.unit.helpers import resolved

    cfg, _, _ = resolved("train.max_steps=40", "checkpoint.every=0")  # save_last: true
    run_dir = write_run_dir(cfg, tmp_path / "run")
    (run_dir / "metrics.jsonl").write_text('{"step": 40, "loss": 5.5}\n')
    (run_dir / "checkpoints" / ".tmp-step-00000040").mkdir(parents=True)
    if state is not None:
        write_state(run_dir, state, 130 if state == "interrupted" else None)
    assert check_run_dir(run_dir, cfg) is None


def test_a_run_dir_prepared_with_the_tokenizer_is_joined(tmp_path):
    """`partrain slurm` (or the first node) copies the data's tokenizer into the run dir with
    its config: the other nodes join it (they were refused: 'not empty')."""
    from partrain.launch.rundir import check_run_dir, write_run_dir
    from tests.unit.helpers import resolved

    cfg, _, _ = resolved()
    run_dir = write_run_dir(cfg, tmp_path / "run")
    (run_dir / "tokenizer").mkdir()
    (run_dir / "tokenizer" / "tokenizer.json").write_text("{}")
    assert check_run_dir(run_dir, cfg) is None
