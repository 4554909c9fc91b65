"""benchmarks/make_tables.py: the quality table names each result's MTraining index settings and
its own plots (a variant run, e.g. --min-vertical 0, renders beside the default one), and the
needle coverage per layer at the longest probed length."""

import copy
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import make_tables  # noqa: E402


def test_quality_variant_renders_beside_the_default():
    path = os.path.join("benchmarks", "results", "quality.json")
    with open(os.path.join(REPO, path)) as f:
        default = json.load(f)
    variant = copy.deepcopy(default)
    variant["mtraining"]["settings"]["min_vertical"] = 0
    variant["summary"]["needle_coverage_per_layer"]["mtraining"]["32768"] = [0.5, 0.0, 0.25, 1.0]
    variant["summary"]["retrieval_accuracy_gap"] = 1.5
    text = make_tables.render_quality([(path, default), ("benchmarks/results/quality_minv.json", variant)])
    assert text.count("| held-out LM loss |") == 2
    assert "min_vertical 0" in text and "min_vertical 256" in text
    assert "`benchmarks/results/quality_minv_loss.png`" in text and "1.5 points" in text
    # The dense run's own index settings are named where they differ from the variant's.
    assert "the dense model under MTraining's index: top-p 0.9, last_q 128, min_vertical 0" in text
    coverage = [line for line in text.splitlines() if line.startswith("| needle coverage by the index at 32K")]
    assert len(coverage) == 2 and coverage[1].split("|")[3].strip() == "0.50 / 0.00 / 0.25 / 1.00"


def _ring_result(commit, world, striped_ms, slow_link=None, dense_ms=None):
    variants = {"sparse_striped": {"fwdbwd_ms": striped_ms}}
    if dense_ms is not None:
        variants["dense_zigzag"] = {"fwdbwd_ms": dense_ms}
    config = {"slow_link_gbps": slow_link, "inner_size": 2} if slow_link else {}
    return {"meta": {"device": "GPU", "commit": commit}, "config": config,
            "runs": [{"seq_len": 524288, "world_size": world, "variants": variants}]}


def test_strong_scaling_pairs_only_plain_runs_of_one_commit():
    results = [("r/1gpu.json", _ring_result("aaaaaaa", 1, 800.0, dense_ms=8000.0)),
               ("r/4gpu.json", _ring_result("aaaaaaa", 4, 210.0, dense_ms=2000.0)),
               ("r/2gpu_old.json", _ring_result("bbbbbbb", 2, 500.0)),            # other kernels
               ("r/4gpu_slow.json", _ring_result("aaaaaaa", 4, 1000.0, slow_link=2.0))]  # other link
    text = make_tables.ring_scaling(results)
    rows = [line for line in text.splitlines() if line.startswith("| GPU |")]
    assert [row.rstrip(" |").split(" | ")[3:8] for row in rows] == [
        ["dense ring, zigzag (ours)", "4", "8000.00", "2000.00", "1.00"],
        ["sparse ring, striped", "4", "800.00", "210.00", "0.95"]]
    summary = make_tables.summarise({"ring": results})
    assert abs(summary["ring_strong_scaling_4gpu"] - 800.0 / (4 * 210.0)) < 1e-9
    assert "commit aaaaaaa" in summary["details"]["ring_strong_scaling_4gpu"]["note"]
    # With the 1-GPU run from other kernels there is no scaling figure at all.
    results[0] = ("r/1gpu.json", _ring_result("ccccccc", 1, 800.0))
    assert make_tables.ring_scaling(results) == ""
    assert make_tables.summarise({"ring": results})["ring_strong_scaling_4gpu"] is None


def test_the_newest_scaling_measurement_wins_whatever_its_commit_hash_h200s_first():
    def timed(result, when):
        result["meta"]["time_utc"] = when
        return result
    # fff... sorts after 000... but ran first: the summary takes 000...'s newer pair.
    results = [("r/1_old.json", timed(_ring_result("fffffff", 1, 800.0), "2026-01-01T00:00:00Z")),
               ("r/4_old.json", timed(_ring_result("fffffff", 4, 200.0), "2026-01-01T00:00:00Z")),
               ("r/1_new.json", timed(_ring_result("0000000", 1, 600.0), "2026-02-01T00:00:00Z")),
               ("r/4_new.json", timed(_ring_result("0000000", 4, 170.0), "2026-02-01T00:00:00Z"))]
    summary = make_tables.summarise({"ring": results})
    assert abs(summary["ring_strong_scaling_4gpu"] - 600.0 / (4 * 170.0)) < 1e-9
    assert "commit 0000000" in summary["details"]["ring_strong_scaling_4gpu"]["note"]
    # An H200 pair wins over a newer pair of another GPU: the targets are defined on H200s.
    for name in ("r/1_old.json", "r/4_old.json"):
        next(data for path, data in results if path == name)["meta"]["device"] = "NVIDIA H200"
    summary = make_tables.summarise({"ring": results})
    assert abs(summary["ring_strong_scaling_4gpu"] - 800.0 / (4 * 200.0)) < 1e-9
    assert "commit fffffff" in summary["details"]["ring_strong_scaling_4gpu"]["note"]


def test_approximator_plot_is_named_by_its_committed_path():
    data = {"meta": {"device": "GPU"}, "quality": [], "plot": "/root/out/approx_gpu_recall.png"}
    text = make_tables.render_approx([("benchmarks/results/approx_gpu.json", data)])
    assert "`benchmarks/results/approx_gpu_recall.png`" in text and "/root/out" not in text


def test_readme_tables_are_generated_from_the_committed_results():
    """The README's performance section and summary.json are what make_tables.py writes now."""
    assert make_tables.main(["--check"]) == 0, "run python benchmarks/make_tables.py and commit the result"


def _e2e_result(world, dense_flags):
    runs = [{"name": "mtraining", "flags": ["--mtraining"], "returncode": 0, "tokens_per_s": 3.0},
            {"name": "dense", "flags": dense_flags, "returncode": 0, "tokens_per_s": 1.0}]
    return {"meta": {"device": "GPU", "commit": "aaaaaaa"}, "world_size": world, "seq_length": 131072,
            "e2e_speedup": 3.0, "runs": runs,
            "model": {"shape_of": "m", "num_layers": 1, "hidden": 1, "ffn": 1, "heads": 1, "kv_groups": 1,
                      "head_dim": 1, "vocab": 1}}


def test_e2e_rows_name_the_dense_baseline_that_ran():
    new = ["--mtraining", "--mtraining-index", "dense", "--mtraining-layout", "zigzag", "--no-mtraining-deterministic"]
    old = ["--mtraining", "--mtraining-index", "dense"]
    text = make_tables.render_e2e([("a.json", _e2e_result(1, new)), ("b.json", _e2e_result(4, new))])
    assert "dense, SDPA (cuDNN)" in text and "dense, cuDNN zigzag ring" in text and "overstate" not in text
    text = make_tables.render_e2e([("a.json", _e2e_result(4, old))])
    assert "baseline: dense index through the sparse kernels" in text and "overstate" in text
    # The striped ring keeps the sparse kernels whatever the determinism flag.
    striped = ["--mtraining", "--mtraining-index", "dense", "--no-mtraining-deterministic"]
    assert make_tables.e2e_label(_e2e_result(4, striped)["runs"][1], 4) == make_tables.OLD_E2E_BASELINE


def test_kernel_targets_come_from_the_targets_shape_only():
    """Kernel results at another density or block size (issue 17's secondary figures) are tabled
    but never stand in for the 128K target figures, whatever their file order."""
    def result(density, block_size, speedup):
        return {"config": {"density": density, "block_size": block_size},
                "runs": [{"seq_len": 131072, "speedup": {"dense_over_ours_fwdbwd": speedup},
                          "ours": {"fwdbwd_tflops": 10 * speedup}}]}
    results = [("r/kernel_a.json", result(0.05, 64, 12.5)), ("r/kernel_report_d025.json", result(0.025, 64, 20.0)),
               ("r/kernel_report_b128.json", result(0.05, 128, 13.2))]
    summary = make_tables.summarise({"kernel": results})
    assert summary["kernel_fwdbwd_speedup_vs_cudnn_128k"] == 12.5
    assert summary["kernel_fwdbwd_effective_tflops_128k"] == 125.0


def test_packed_targets_come_from_the_benchmark_mix_where_it_ran():
    """The packed quality targets read the ProLong mix at 128K (quality_packed_prolong.json) when it
    exists, else the random documents at 32K; the packed ring gives its speedup and imbalance keys."""
    def quality(density):
        return {"meta": {"device": "GPU"}, "summary": {"final_loss_gap": 0.001, "retrieval_accuracy_gap": 0.5,
                                                        "mean_density": density}}
    random_docs = ("benchmarks/results/quality_packed.json", quality(0.25))
    prolong = ("benchmarks/results/quality_packed_prolong.json", quality(0.08))
    summary = make_tables.summarise({"quality": [random_docs]})
    assert summary["packed_mean_density"] == 0.25 and summary["details"]["packed_mean_density"]["met"] is False
    summary = make_tables.summarise({"quality": [random_docs, prolong]})
    assert summary["packed_mean_density"] == 0.08 and summary["details"]["packed_mean_density"]["met"] is True
    assert "ProLong mix at 128K" in summary["details"]["packed_mean_density"]["note"]
    assert "0.250 (quality_packed.json)" in summary["details"]["packed_mean_density"]["note"]
    ring = _ring_result("aaaaaaa", 2, 90.0, dense_ms=1800.0)
    striped = ring["runs"][0]["variants"]["sparse_striped"]
    striped["speedup"] = {"vs_best_dense": 20.0}
    striped["steps"] = {"fwd_bwd": {"imbalance": {"worker_imbalance": 1.02, "step_imbalance": 1.09}}}
    summary = make_tables.summarise({"ringpacked": [("r/ringpacked_2gpu.json", ring)]})
    assert summary["packed_ring_speedup_vs_dense_512k_2gpu"] == 20.0
    assert summary["packed_ring_step_imbalance"] == 1.09 and summary["packed_ring_worker_imbalance"] == 1.02


def test_imbalance_figures_come_from_the_newest_h200_run_not_the_last_file_name():
    """The paper's imbalance keys take the same precedence as the other ring figures (an H200's
    run, then the newest), whatever the files' names sort as."""
    def run(commit, device, when, step):
        result = _ring_result(commit, 4, 150.0)
        result["meta"].update(device=device, time_utc=when)
        result["runs"][0]["variants"]["sparse_striped"]["steps"] = {
            "fwd_bwd": {"imbalance": {"worker_imbalance": 1.01, "step_imbalance": step, "computation_ratio": 0.99}}}
        return result

    results = [("r/ring_4gpu_scaling.json", run("ccccccc", "NVIDIA H200", "2026-11-27T08:00", 1.05)),
               ("r/ring_4gpu_scaling_aaaaaaa.json", run("aaaaaaa", "NVIDIA H200", "2026-11-26T08:00", 1.8)),
               ("r/ring_4gpu_scaling_zzz.json", run("bbbbbbb", "NVIDIA H100", "2026-11-28T08:00", 1.6))]
    summary = make_tables.summarise({"ring": results})
    assert summary["step_imbalance"] == 1.05 and summary["details"]["step_imbalance"]["met"] is True
    assert summary["details"]["step_imbalance"]["source"] == "r/ring_4gpu_scaling.json"
    assert "commit ccccccc" in summary["details"]["step_imbalance"]["note"]


def test_flagship_keys_pair_the_fastest_runs_of_one_precision_and_take_the_worst_planner_errors():
    def run(name, tokens_per_s, mtraining, fp8=False, speed_error=0.0, memory_error=0.0):
        argv = ["--num-layers", "36"] + (["--mtraining"] if mtraining else []) + (["--fp8-format", "hybrid"] if fp8
                                                                                  else [])
        return {"name": name, "megatron_argv": argv, "tokens_per_s": tokens_per_s, "returncode": 0,
                "planner_tokens_per_s_error": speed_error, "planner_memory_error": memory_error}

    data = {"model": "qwen2.5_3b", "seq_length": 262144, "world_size": 4, "meta": {"device": "NVIDIA H200"},
            "runs": [run("mtraining", 50e3, True, speed_error=-0.04, memory_error=0.02),
                     run("mtraining+block 30", 56e3, True, speed_error=0.12),
                     run("te_cp", 10e3, False, memory_error=-0.08), run("te_cp+block 30", 9e3, False),
                     run("mtraining fp8", 70e3, True, fp8=True), run("te_cp fp8", 10e3, False, fp8=True)]}
    values = make_tables.flagship_values([("flagship.json", data)])
    assert values["flagship_qwen2.5_3b_256k_4gpu_vs_te_cp"][0] == 5.6
    assert values["flagship_qwen2.5_3b_256k_4gpu_vs_te_cp_fp8"][0] == 7.0
    assert values["flagship_planner_max_abs_error"][0] == 0.12
    assert values["flagship_memory_max_abs_error"][0] == 0.08
    summary = make_tables.summarise({"flagship": [("flagship.json", data)]})
    assert summary["details"]["flagship_qwen2.5_3b_256k_4gpu_vs_te_cp"]["met"] is True
    assert summary["flagship_llama3.1_8b_512k_8gpu_vs_te_cp"] is None


def test_block_kernel_keys_come_from_the_moba_run_at_128k_and_leave_the_vs_keys_alone():
    """kernel.py --index block: the block keys from its MoBA pattern at 128K; its vertical-slash
    figures (run without cuDNN) never stand in for the plain run's keys; the table shows the block rows."""
    def result(index, pattern, rate_ratio, flex_speedup, cudnn):
        run = {"seq_len": 131072, "index": {"density_mean": 0.05}, "speedup": {"dense_over_ours_fwdbwd": cudnn},
               "ours": {"fwdbwd_tflops": 400.0}}
        if index == "block":
            run["block"] = {"pattern": pattern, "index": {"density_mean": 0.05, "moba_block_size": 512, "moba_top_k": 7},
                            "ours": {"fwdbwd_ms": 10.0, "fwdbwd_tflops": 380.0}, "flex": {"fwdbwd_ms": 25.0},
                            "rate_ratio_over_vs": {"fwdbwd": rate_ratio}, "speedup": {"flex_over_ours_fwdbwd": flex_speedup}}
        return {"meta": {"device": "GPU"}, "config": {"density": 0.05, "block_size": 64, "index": index},
                "runs": [run]}
    results = [("r/kernel_block_moba.json", result("block", "moba", 0.95, 2.5, None)),
               ("r/kernel_block_random.json", result("block", "random", 0.5, 9.0, None)),
               ("r/kernel_gpu.json", result("vs", None, None, None, 13.0))]
    summary = make_tables.summarise({"kernel": results})
    assert summary["block_kernel_rate_ratio_128k"] == 0.95 and summary["block_speedup_vs_flex_128k"] == 2.5
    assert summary["details"]["block_kernel_rate_ratio_128k"]["met"] is True
    assert "top-7" in summary["details"]["block_speedup_vs_flex_128k"]["note"]
    assert summary["kernel_fwdbwd_speedup_vs_cudnn_128k"] == 13.0
    assert summary["details"]["block_speedup_vs_flex_128k"]["target"] == ">= 2"
    text = make_tables.render_kernel(results)
    assert "| GPU | 128K | moba | 0.050 (0.050) |" in text and "| random |" in text


def test_ring_moba_keys_come_from_the_sparse_moba_variant_at_512k_4gpu():
    ring = _ring_result("aaaaaaa", 4, 150.0, dense_ms=1800.0)
    ring["runs"][0]["moba_index"] = {"density_mean": 0.054, "moba_top_k": 4}
    ring["runs"][0]["variants"]["sparse_moba"] = {
        "fwdbwd_ms": 240.0, "speedup": {"vs_best_dense": 7.5}, "pattern": "MoBA, 4096-token blocks, top-4",
        "steps": {"fwd_bwd": {"imbalance": {"worker_imbalance": 1.08, "step_imbalance": 1.2,
                                            "computation_ratio": 0.9}}}}
    summary = make_tables.summarise({"ring": [("r/ring_4gpu.json", ring)]})
    assert summary["ring_moba_speedup_vs_dense_512k_4gpu"] == 7.5 and summary["ring_moba_worker_imbalance"] == 1.08
    assert summary["details"]["ring_moba_speedup_vs_dense_512k_4gpu"]["met"] is True
    assert summary["details"]["ring_moba_worker_imbalance"]["target"] == "<= 1.1"
    assert "top-4" in summary["details"]["ring_moba_worker_imbalance"]["note"]
    assert make_tables.summarise({"ring": [("r/ring_4gpu.json", _ring_result("a", 4, 1.0))]})[
        "ring_moba_speedup_vs_dense_512k_4gpu"] is None
