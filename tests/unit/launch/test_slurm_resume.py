"""`partrain slurm --resume RUN_DIR`: a run continued on another allocation, its config and script
rewritten and put back when sbatch refuses or does not answer, refused while a queued job of this
user will train in the run dir (squeue asked by uid) or when the run is trained to the end. With
stub `sbatch`/`squeue` (no cluster; the real daemons run in tests/integration/test_slurm.py)."""

from pathlib import Path

import pytest


def _squeue_stub(bin_dir: Path, lines: str = "") -> None:
    """An `squeue` that lists `lines` as this user's jobs (`%i|%T|%Z|%o`)."""
    stub = bin_dir / "squeue"
    stub.write_text(f"#!/bin/sh\nprintf '%s' '{lines}'\n")
    stub.chmod(0o755)


def test_slurm_resume_continues_a_run_on_other_nodes(run_main, tmp_path, sbatch_stub):
    """`partrain slurm --resume RUN_DIR --nodes N`: a run continued on another allocation (the
    only ways before were its old script, for its old node count, or `launch --resume` by hand).
    dp follows the ranks asked for, the config and the script are rewritten, the job resumes."""
    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 100)
    sbatch_stub(f'echo "$@" > {tmp_path}/sbatch-args; echo "77"')
    _squeue_stub(tmp_path / "bin")
    result = run_main("slurm", "--resume", str(run_dir), "train.max_steps=400", "--nodes", "2",
                      "--nproc-per-node", "2")
    assert result.code == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert (f"submitted job 77: 2 node(s) x 2 rank(s); run dir {run_dir}; it resumes from step "
            f"100 ({run_dir}/checkpoints/step-00000100)") in said, said
    assert "changed on resume: launcher.nnodes 1 -> 2" in said and "parallel.dp 2 -> 4" in said
    frozen = (run_dir / "config.yaml").read_text()
    assert "nnodes: 2" in frozen and "dp: 4" in frozen and "max_steps: 400" in frozen
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "--nnodes 2 --nproc-per-node 2" in script
    assert (run_dir / "checkpoints" / "step-00000100").is_dir()


def test_slurm_resume_that_sbatch_refuses_puts_the_run_back(run_main, tmp_path, sbatch_stub):
    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 100)
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n# the old script\n")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    sbatch_stub('echo "sbatch: error: QOSMaxNodePerJobLimit" >&2; exit 1')
    _squeue_stub(tmp_path / "bin")
    result = run_main("slurm", "--resume", str(run_dir), "--nodes", "4", "--nproc-per-node", "2")
    assert result.code == 2 and "QOSMaxNodePerJobLimit" in result.stderr, result.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_run_dir_a_queued_job_will_train_in_takes_no_resume_job(run_main, tmp_path, sbatch_stub):
    """A job of this user still pending or running the run dir's script: a second would train in
    the same run dir at once (its checkpoints pruned by the other). squeue says which."""
    from tests.unit.checkpoint.builders import write_run_dir

    sbatch_stub(f": > {tmp_path}/submitted; echo 78")
    run_dir = write_run_dir(tmp_path / "run", 100)
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    # Submitted from the run dir by hand (`sbatch job.sbatch`): its path relative to the job's.
    _squeue_stub(tmp_path / "bin", f"12|RUNNING|/elsewhere|/x.sbatch\n"
                                   f"13|PENDING|{run_dir}|job.sbatch\n")
    args = ("slurm", "--resume", str(run_dir), "--nodes", "2", "--nproc-per-node", "2")
    result = run_main(*args)
    said = " ".join(result.stderr.split())
    assert result.code == 2, said
    assert (f"--resume {run_dir}: job 13 (PENDING) runs its script {run_dir}/job.sbatch; two "
            "jobs would train in one run dir at once. Wait for it to end, or end it (scancel "
            "13), and submit again") in said, said
    assert not (tmp_path / "submitted").exists()
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # Once it is gone from the queue, the same command submits.
    _squeue_stub(tmp_path / "bin", "12|RUNNING|/elsewhere|/x.sbatch\n")
    result = run_main(*args)
    assert result.code == 0 and (tmp_path / "submitted").exists(), result.stderr


def test_slurm_resume_of_a_finished_run_submits_nothing(run_main, tmp_path, sbatch_stub):
    """The job would start, say "nothing to do" and end: refused before the submission."""
    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 300)  # the quickstart's train.max_steps
    sbatch_stub(f": > {tmp_path}/submitted; echo 1")
    _squeue_stub(tmp_path / "bin")
    result = run_main("slurm", "--resume", str(run_dir), "--nodes", "1")
    said = " ".join(result.stderr.split())
    assert result.code == 2 and f"--resume {run_dir} is trained to step 300 = train.max_steps" \
        in said and "train.max_steps=N --nodes 1" in said, said
    assert not (tmp_path / "submitted").exists() and not (run_dir / "job.sbatch").exists()


@pytest.mark.parametrize("how", ["not executable", "timeout"])
def test_slurm_resume_whose_sbatch_fails_to_answer(run_main, tmp_path, sbatch_stub, monkeypatch,
                                                   how):
    """An sbatch that cannot run: exit 2, the files put back (modes too). One that does not
    answer in time may have queued the job: the new script and config stay, and it says so."""
    from partrain.launch import slurm
    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 100)
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n#SBATCH --partition=p1\n")
    (run_dir / "job.sbatch").chmod(0o755)
    before = {p: (p.read_bytes(), p.stat().st_mode) for p in run_dir.rglob("*") if p.is_file()}
    stub = sbatch_stub("exec /bin/sleep 5")
    _squeue_stub(tmp_path / "bin")
    if how == "not executable":
        stub.chmod(0o644)
    monkeypatch.setattr(slurm, "SBATCH_TIMEOUT_S", 1)
    result = run_main("slurm", "--resume", str(run_dir), "--nodes", "1", "--nproc-per-node", "1")
    said = " ".join(result.stderr.split())
    assert result.code == 2 and "Traceback" not in said, said
    # The earlier script's own settings, not asked again, are named (a resume takes flags anew).
    assert f"{run_dir}/job.sbatch asked for --partition=p1, which this job does not" in said
    after = {p: (p.read_bytes(), p.stat().st_mode) for p in run_dir.rglob("*") if p.is_file()}
    if how == "not executable":
        assert "sbatch could not be run (Permission denied)" in said, said
        assert after == before
    else:
        assert "sbatch did not answer within 1 s, so whether the job was queued is unknown" \
            in said and "see `squeue --me`" in said, said
        assert "nproc_per_node: 1" in (run_dir / "config.yaml").read_text()
        assert "--nproc-per-node 1" in (run_dir / "job.sbatch").read_text()


def test_the_queue_is_asked_by_uid_and_read_whatever_its_bytes(run_main, tmp_path, sbatch_stub):
    """squeue -u of a name that is not the caller's ($USER set to another) lists nothing and
    exits 0: the check was silently off. A byte that is not UTF-8 in another job's line was a
    traceback. A job given arguments (`sbatch job.sbatch x`) is still its script's."""
    import os

    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 100)
    sbatch_stub("echo 5")
    squeue = tmp_path / "bin" / "squeue"
    squeue.write_bytes(
        b'#!/bin/sh\n[ "$3" = "' + str(os.getuid()).encode() + b'" ] || exit 0\n'
        b"printf '9|RUNNING|/x|\\377\\376.sbatch\\n'\n"
        b"printf '13|RUNNING|" + str(run_dir).encode() + b"|job.sbatch extra args\\n'\n")
    squeue.chmod(0o755)
    result = run_main("slurm", "--resume", str(run_dir), "--nodes", "1", "--nproc-per-node", "1")
    said = " ".join(result.stderr.split())
    assert result.code == 2 and "job 13 (RUNNING) runs its script" in said, said
