"""torchrun's spellings on `partrain launch` and `partrain slurm` (launch/torchrun.py, cli.py):
what each alias becomes in partrain's own terms, the counts behind --nproc-per-node gpu|cpu|auto,
the contradictions refused, and unknown flags answered by meaning (--num_gpus is
--nproc-per-node, not whatever is spelt nearest)."""

import pytest

from partrain.errors import ConfigError
from partrain.launch.torchrun import count_nproc, read_nnodes, read_nproc


@pytest.fixture
def asked(monkeypatch):
    """The Request `partrain launch` hands to start(), with nothing started."""
    import partrain.launch.start as start_module

    seen = []

    def fake_start(request, dry_run, out, err, warn):
        seen.append(request)
        return 0

    monkeypatch.setattr(start_module, "start", fake_start)
    return seen


@pytest.mark.parametrize("flags, expected", [
    (["--nproc_per_node", "3"], {"nproc_per_node": 3}),
    (["--nproc-per-node", "GPU"], {"nproc_per_node": "gpu"}),
    (["--nproc_per_node=cpu"], {"nproc_per_node": "cpu"}),
    (["--nproc-per-node", "auto"], {"nproc_per_node": "auto"}),
    (["--nnodes", "2:2", "--node_rank", "1", "--rdzv_endpoint", "node0:29400"],
     {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0:29400",
      "rdzv_from": "--rdzv-endpoint"}),
    (["--master_addr", "10.0.0.1", "--master_port", "29501"],
     {"rdzv_endpoint": "10.0.0.1:29501", "rdzv_from": "--master-addr/--master-port"}),
    (["--master-addr", "node0"], {"rdzv_endpoint": "node0:29500"}),  # torchrun's default port
    (["--master-port", "29400"], {"rdzv_endpoint": "127.0.0.1:29400"}),  # and default address
    (["--master_addr", "fd00::1"], {"rdzv_endpoint": "[fd00::1]:29500"}),
    (["--standalone"], {"nnodes": 1, "node_rank": 0, "rdzv_endpoint": None}),
    (["--standalone", "--rdzv_backend", "c10d", "--rdzv_id", "x"], {"nnodes": 1, "rdzv_id": "x"}),
    (["--rdzv_id", "job-7", "--rdzv-backend", "static"], {"rdzv_id": "job-7"}),
    (["--local_addr", "10.0.0.2"], {"local_addr": "10.0.0.2"}),
    ([], {"nnodes": None, "nproc_per_node": None, "rdzv_endpoint": None, "rdzv_id": None}),
])
def test_each_torchrun_spelling_maps_to_partrains(run_main, asked, flags, expected):
    result = run_main("launch", *flags)
    assert result.code == 0, result.stderr
    request, = asked
    assert {key: getattr(request, key) for key in expected} == expected


def test_max_restarts_underscore_is_the_key(run_main, asked):
    assert run_main("launch", "--max_restarts", "2").code == 0
    assert asked[0].args == ["launcher.max_restarts=2"]


@pytest.mark.parametrize("flag", ["--start-method", "--start_method"])
def test_start_method_is_the_key(run_main, asked, flag):
    assert run_main("launch", flag, "spawn").code == 0
    assert asked[0].args == ["launcher.start_method=spawn"]


def test_torchruns_fork_start_method_is_refused_with_the_way_out(run_main):
    """Validated as the key is, before anything starts: exit 2, one line, forkserver named."""
    result = run_main("launch", "--start-method", "fork", "--dry-run")
    assert result.code == 2, result.stderr
    assert "launcher.start_method=fork is not offered" in result.stderr
    assert "launcher.start_method=forkserver" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, fragments", [
    (["--standalone", "--nnodes", "2"], ["--standalone", "--nnodes 2"]),
    (["--standalone", "--rdzv-endpoint", "h:1"], ["--standalone", "--rdzv-endpoint"]),
    (["--standalone", "--master_addr", "h"], ["--standalone", "--master-addr"]),
    (["--master_addr", "h", "--rdzv_endpoint", "h:1"], ["--master-addr", "--rdzv-endpoint h:1",
                                                         "give one"]),
    (["--rdzv_backend", "etcd"], ["--rdzv-backend etcd", "c10d"]),
    (["--rdzv_id", "a b"], ["--rdzv-id", "without spaces"]),
    (["--nnodes", "1:4"], ["fixed number of nodes", "--nnodes 4"]),
    (["--nnodes", "two"], ["--nnodes", "'two'"]),
    (["--nproc-per-node", "gpus"], ["--nproc-per-node='gpus' is not a whole number or one of"]),
    (["--master_port", "0"], ["--master-port=0", "at least 1"]),
])
def test_contradictions_and_bad_values_are_refused(run_main, asked, flags, fragments):
    result = run_main("launch", *flags)
    assert result.code == 2 and not asked, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_readers_directly():
    assert read_nproc(" 8 ") == 8 and read_nproc("Auto") == "auto"
    with pytest.raises(ValueError, match="not a whole number or one of gpu, cpu, auto"):
        read_nproc("xpu")
    assert read_nnodes("3") == 3 and read_nnodes("3:3") == 3
    with pytest.raises(ValueError, match="at least 1"):
        read_nnodes("0:0")
    # Both suggestions the same count (it said "--nnodes 2 (or 1:1)")
    with pytest.raises(ValueError, match=r"give --nnodes 2 \(or 2:2\)"):
        read_nnodes("1:2")


def test_counts_follow_torchrun():
    """gpu: the visible GPUs, none refused; cpu: the cores; auto: the GPUs the workers use, else
    the cores (torch/distributed/run.py, determine_local_world_size)."""
    assert count_nproc("gpu", 4, 16, True)[0] == 4
    assert count_nproc("gpu", 4, 16, False)[0] == 4
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        count_nproc("gpu", 0, 16, False)
    assert count_nproc("cpu", 4, 16, True) == (16, "--nproc-per-node cpu (16 usable core(s))")
    assert count_nproc("auto", 4, 16, True) == (4, "--nproc-per-node auto (4 visible GPU(s))")
    assert count_nproc("auto", 4, 16, False)[0] == 16  # launcher.device=cpu: the cores
    assert count_nproc("auto", 0, 16, True)[0] == 16


@pytest.fixture
def machine(monkeypatch):
    """This machine's GPUs and cores as preflight counts them."""
    import partrain.launch.preflight as preflight

    def set_machine(gpus: int, cores: int) -> None:
        monkeypatch.setattr(preflight, "cuda_count", lambda share=None: gpus)
        monkeypatch.setattr(preflight, "usable_cores", lambda: cores)
    return set_machine


@pytest.mark.parametrize("word, gpus, cores, workers", [
    ("cpu", 0, 1, 1), ("auto", 0, 1, 1), ("gpu", 1, 8, 1),
])
def test_words_count_this_node_in_a_dry_run(run_main, machine, tmp_path, monkeypatch, word,
                                            gpus, cores, workers):
    monkeypatch.chdir(tmp_path)
    machine(gpus, cores)
    result = run_main("launch", "--dry-run", "--nproc-per-node", word, "launcher.device=cpu",
                      "parallel.dp=auto", "--run-dir", "run")
    assert result.code == 0, result.stderr
    assert f"start {workers} worker(s) on this node" in " ".join(result.stdout.split())


def test_gpu_without_gpus_exits_2(run_main, machine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    machine(0, 8)
    result = run_main("launch", "--dry-run", "--nproc-per-node", "gpu", "--run-dir", "run")
    assert result.code == 2 and "--nproc-per-node gpu: no CUDA device is visible" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_word_says_where_the_count_came_from(run_main, machine, tmp_path, monkeypatch):
    """The world-size rule names the word and what it counted, not a bare number."""
    monkeypatch.chdir(tmp_path)
    machine(0, 3)
    result = run_main("launch", "--dry-run", "--nproc-per-node", "cpu", "launcher.device=cpu",
                      "parallel.dp=2", "--run-dir", "run")
    assert result.code == 2 and "--nproc-per-node cpu (3 usable core(s))" in result.stderr


@pytest.fixture
def job(monkeypatch):
    """The Request `partrain slurm` hands to prepare_job, with nothing written."""
    import partrain.launch.start as start_module

    seen = []
    monkeypatch.setattr(start_module, "prepare_job",
                        lambda request, *a, **k: seen.append(request))
    return seen


def test_slurm_takes_torchrun_spellings(run_main, job):
    result = run_main("slurm", "--nnodes", "2", "--nproc_per_node", "4", "--max_restarts", "1")
    assert result.code == 0, result.stderr
    request, = job
    assert (request.nnodes, request.nproc_per_node) == (2, 4)
    assert request.args == ["launcher.max_restarts=1"]


def test_slurm_refuses_a_device_word(run_main, job):
    """The login node's devices are not the job's: the word is refused, naming what to give."""
    result = run_main("slurm", "--nodes", "2", "--nproc-per-node", "gpu")
    assert result.code == 2 and not job
    assert "--gpus-per-node G" in result.stderr and "login node" in result.stderr


@pytest.mark.parametrize("command, flag, meant", [
    ("launch", "--num_gpus", "--nproc-per-node"),  # DeepSpeed's launcher
    ("slurm", "--num_gpus", "--gpus-per-node"),
    ("launch", "--num_processes", "--nproc-per-node"),  # Accelerate
    ("launch", "--num_machines", "--nnodes"),
    ("slurm", "--num_nodes", "--nodes"),
    ("launch", "--machine_rank", "--node-rank"),
    ("launch", "--main_process_ip", "--rdzv-endpoint"),
    ("launch", "--output_dir", "--run-dir"),
    ("export", "--output-dir", "--out"),
    ("launch", "--resume_from_checkpoint", "--resume"),
])
def test_unknown_flags_are_answered_by_meaning(run_main, command, flag, meant):
    result = run_main(command, flag, "1")
    assert result.code == 2
    assert f"No such option: {flag} (did you mean {meant}?)" in result.stderr, result.stderr


@pytest.mark.parametrize("flag, says", [
    ("--tee", "each rank writes its output to RUN_DIR/logs/rank-N.log"),
    ("--redirects", "each rank writes its output to RUN_DIR/logs/rank-N.log"),
    ("--rdzv_conf", "its timeout is the override launcher.rdzv_timeout_s=SECONDS"),
    ("--no-python", "model.target=pkg.module:build"),
    ("--monitor_interval", "watches the ranks itself"),
    ("-m", "model.target=pkg.module:build"),
])
def test_torchruns_own_flags_say_what_partrain_does_instead(run_main, flag, says):
    """torchrun's flags with no partrain flag: their nearest spelling meant something else
    (--tee suggested --resume, --rdzv_conf --rdzv-backend)."""
    result = run_main("launch", flag, "3")
    said = " ".join(result.stderr.split())
    assert result.code == 2 and f"No such option: {flag} (torchrun's {flag[:2]}" in said, said
    assert says in said and "Possible options" not in said, said


def test_master_addr_is_never_read_as_local_addr(run_main, asked):
    """--master-addr is node 0's address; --local-addr, the nearest spelling, is this node's."""
    assert run_main("launch", "--master-addr", "node0").code == 0
    assert (asked[0].rdzv_endpoint, asked[0].local_addr) == ("node0:29500", None)


def test_slurm_says_it_sets_the_rendezvous(run_main):
    result = run_main("slurm", "--nodes", "2", "--master_addr", "node0")
    assert result.code == 2 and "partrain slurm sets where the nodes meet itself" in result.stderr
    assert "--local-addr" not in result.stderr


def test_hydra_config_flags_point_at_the_first_argument(run_main):
    result = run_main("launch", "--config-name", "quickstart")
    assert result.code == 2 and "the config is the first argument" in result.stderr


@pytest.mark.parametrize("argv, env", [
    ([], {}),  # by hand, nothing given: it was an IndexError
    (["launcher.device=cpu", "train.max_steps=2"], {"RANK": "0", "WORLD_SIZE": "1"}),  # torchrun
    (["RUN_DIR"], {}),  # a run dir, and no agent's RANK: it was a KeyError
])
def test_the_worker_started_by_hand_or_torchrun_says_what_to_run(tmp_path, argv, env):
    """`torchrun -m partrain.train OVERRIDES`, an Accelerate user's habit, and the worker started
    by hand: one line that names `partrain launch`, exit 2, no traceback."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: x\n")
    argv = [str(run_dir) if a == "RUN_DIR" else a for a in argv]
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "partrain.train", *argv], capture_output=True,
                          text=True, env={**clean, **env}, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: python -m partrain.train is the worker that "
                                  "`partrain launch` starts"), done.stderr
    assert "Run `partrain launch" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_this_nodes_gpus_is_refused(run_main, machine, tmp_path, monkeypatch,
                                                    device):
    """Each rank takes the GPU of its local rank: ranks past the node's GPUs failed at their
    first CUDA call, after the others had started (GPUs counted by a stand-in: this machine has
    none). On the CPU the same count is fine."""
    monkeypatch.chdir(tmp_path)
    machine(2, 8)
    result = run_main("launch", "--dry-run", "--nproc-per-node", "4", f"launcher.device={device}",
                      "parallel.dp=auto", "--run-dir", "run")
    assert result.code == 2
    said = " ".join(result.stderr.split())
    assert "4 ranks on this node (--nproc-per-node), which shows 2 GPU(s)" in said, said
    assert "--nproc-per-node 2" in said and not (tmp_path / "run").exists()
    fine = run_main("launch", "--dry-run", "--nproc-per-node", "4", "launcher.device=cpu",
                    "parallel.dp=auto", "--run-dir", "run")
    assert fine.code == 0, fine.stderr


def test_a_run_dir_started_by_torchrun_with_another_world_size_is_one_line(tmp_path):
    """`torchrun --nproc_per_node 1 -m partrain.train RUN_DIR` on a run dir resolved for 2
    ranks failed inside every rank (the mesh is bigger than the world, a traceback); with the
    same count it trains (the reviewer's run)."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: x\nlauncher:\n  nnodes: 1\n  nproc_per_node: 2\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-m", "partrain.train", str(run_dir)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {run_dir} was resolved for 2 rank(s)"), done.stderr
    assert "WORLD_SIZE=1" in done.stderr and "Traceback" not in done.stderr
