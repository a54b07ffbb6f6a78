"""What `partrain plan --search` enumerates and keeps from the config (a reviewer's findings):
every tp and cp degree partrain runs, not powers of two alone; the config's HSDP replicas and cp
method priced as the recipe it writes will run them; parameter offload refused rather than
written into layouts that cannot take it; a search where nothing fits is exit 2."""

import json

SMALL = ("model.n_heads=6", "model.n_kv_heads=6", "model.dim=192", "model.ffn_dim=576",
         "model.vocab_size=258", "train.global_batch_size=12", "train.seq_len=96")


def _search(run_main, *args):
    res = run_main("plan", "--search", *args, "--json")
    return res, (json.loads(res.stdout) if res.stdout else None)


def test_tp_and_cp_of_three_are_searched(run_main):
    """6 heads on 6 GPUs: tp=3 divides every size (partrain runs it), and was refused as "tp (in
    [1, 2]) must divide model.n_heads=6 ..." because only powers of two were tried; cp=3 splits
    a 96-token sequence in 6 chunks. A tp that does not divide the sequence is named as such."""
    res, found = _search(run_main, *SMALL, "--gpus", "6", "--explain", "tp=3")
    assert res.code == 0, res.stderr
    assert found["explain"]["verdict"] != "not enumerated", found["explain"]
    res, found = _search(run_main, *SMALL[:-1], "train.seq_len=100", "--gpus", "6", "--explain",
                         "tp=3")
    assert found["explain"]["reason"].startswith("tp(3) * cp(1) = 3 must divide "
                                                 "train.seq_len=100"), found["explain"]
    res, found = _search(run_main, *SMALL, "--gpus", "6", "--explain", "cp=3")
    assert res.code == 0, res.stderr
    assert found["explain"]["verdict"] != "not enumerated", found["explain"]


def test_the_configs_hsdp_and_cp_method_are_priced_as_the_recipe_runs_them(run_main, tmp_path):
    """parallel.dp_replicate and parallel.cp_method were left out of the layouts priced and kept
    in the recipe written: the search said 69.8 GiB, `plan` of its recipe 76.1 GiB (HSDP), and
    ring's tokens/s for an all-to-all recipe. Now the search prices what the recipe runs."""
    for extra in (("model=llama-7b", "train.seq_len=4096", "train.global_batch_size=256",
                   "parallel.dp_replicate=2", "--gpus", "16"),
                  ("model=llama-7b", "model.max_seq_len=32768", "train.seq_len=32768",
                   "train.global_batch_size=48", "parallel.cp_method=all_to_all", "--gpus", "12",
                   "--gpus-per-node", "6")):
        recipe = tmp_path / f"{len(list(tmp_path.iterdir()))}.yaml"
        res, found = _search(run_main, *extra, "--write-recipe", str(recipe))
        assert res.code == 0, res.stderr
        best = found["best"][0]
        if "parallel.dp_replicate=2" in extra:
            assert all(c["layout"]["zero_backend"] == "fsdp" and c["layout"]["dp_replicate"] == 2
                       and c["layout"]["dp"] % 2 == 0 for c in found["best"])
        else:
            assert best["layout"]["cp"] > 1 and best["layout"]["cp_method"] == "all_to_all"
        res = run_main("plan", str(recipe), "--hardware", "H100", "--json")
        assert res.code == 0, res.stderr
        planned = json.loads(res.stdout)
        assert max(s["total"] for s in planned["memory_per_stage"]) == best["memory_bytes"]
        assert planned["time"]["tokens_per_s"] == best["tokens_per_s"]


def test_parameter_offload_is_refused_by_the_search(run_main):
    """It never tried it, and wrote it into every layout: "none of the 40 best layouts that fit
    passes partrain's validation: parallel.offload_params=cpu needs parallel.zero_stage=3"."""
    res = run_main("plan", "--search", "model=llama-7b", "parallel.offload_params=cpu",
                   "--gpus", "8")
    assert res.code == 2 and "parallel.offload_params=cpu: plan --search does not try" in \
        res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_search_where_nothing_fits_is_exit_2(run_main):
    """It printed "nothing fits" and exited 0 (with --json, "best": [] and 0), as if answered."""
    res, found = _search(run_main, "model=llama-70b", "--gpus", "1")
    assert res.code == 2 and found["best"] == [], res.stderr
    said = " ".join(res.stderr.split())
    assert said.startswith("error: no layout of --gpus 1 fits in 90% of H100-SXM's 80 GiB: the "
                           "smallest, "), said
    assert "give more GPUs (--gpus)" in said
    res = run_main("plan", "--search", "model=llama-70b", "--gpus", "1")
    assert res.code == 2 and "no layout of --gpus 1 fits" in res.stderr


def test_the_optimizers_state_is_the_configs(run_main):
    """The search counted AdamW's 8 bytes of state per parameter whatever optim.name said: SGD
    without momentum holds none, so the same layout needs less memory (what `plan` says too)."""
    args = ("model=llama-1b", "train.seq_len=2048", "train.global_batch_size=64", "--gpus", "8",
            "--explain", "dp=8 zero_stage=0 mb=1 ckpt=none")
    sizes = {}
    for name, optim in (("adamw", ()), ("sgd", ("optim.name=sgd", "optim.momentum=0"))):
        res, found = _search(run_main, *args, *optim)
        assert res.code == 0, res.stderr
        sizes[name] = found["explain"]["best_variant"]["memory_bytes"]
        res = run_main("plan", *args[:3], *optim, "parallel.dp=8", "train.micro_batch_size=1",
                       "launcher.device=cuda", "launcher.nproc_per_node=8", "--hardware", "H100",
                       "--json")
        assert res.code == 0, res.stderr
        assert max(s["total"] for s in json.loads(res.stdout)["memory_per_stage"]) == sizes[name]
    assert sizes["sgd"] < sizes["adamw"]


def test_explain_names_the_rules_of_the_configs_cp_method_and_replicas(run_main):
    """"no layout the search enumerates has all of these values together" was said where the
    config's all-to-all head rule or its HSDP replicas left the layout out (today's review)."""
    _, found = _search(run_main, "model=llama-7b", "parallel.cp_method=all_to_all",
                       "train.seq_len=4092", "model.max_seq_len=4096",
                       "train.global_batch_size=48", "--gpus", "48", "--explain", "cp=3")
    assert found["explain"]["reason"].startswith(
        "parallel.cp_method=all_to_all gives each cp rank 1/cp of a tp rank's heads: cp=3 must "
        "divide model.n_heads=32"), found["explain"]
    _, found = _search(run_main, "model=llama-7b", "parallel.dp_replicate=4", "train.seq_len=4096",
                       "train.global_batch_size=48", "--gpus", "48", "--explain", "dp=6 tp=8")
    assert found["explain"]["reason"] == ("parallel.dp_replicate=4 (HSDP) must divide dp=6: the "
                                          "search keeps the config's replicas"), found["explain"]


def test_tp_groups_fill_nodes_evenly(run_main):
    """tp=3 on nodes of 8 puts a group across a node's edge (slow, and one more degree to price
    for every model with many divisors: a search 7 to 14 times longer); on nodes of 6 it fills
    them."""
    args = (*SMALL, "--gpus", "48", "--explain", "tp=3")
    _, on_8 = _search(run_main, *args, "--gpus-per-node", "8")
    assert on_8["explain"]["verdict"] == "not enumerated", on_8["explain"]
    _, on_6 = _search(run_main, *args, "--gpus-per-node", "6")
    assert on_6["explain"]["verdict"] != "not enumerated", on_6["explain"]
