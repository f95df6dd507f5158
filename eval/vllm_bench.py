"""vLLM's own serving benchmark (`vllm bench serve`), run without the `vllm` script (the CPU build's script
fails on its package metadata): the same parser and main, from vllm/benchmarks/serve.py.

    python -m eval.vllm_bench --base-url http://127.0.0.1:8000 --model DIR --served-model-name NAME ...
"""

from eval.child import watch_parent

if __name__ == "__main__":
    watch_parent()  # a benchmark left running would keep loading a server that is being stopped
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM's serving benchmark (vllm bench serve)")
    add_cli_args(parser)
    main(parser.parse_args())
