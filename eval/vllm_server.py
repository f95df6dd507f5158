"""vLLM's OpenAI-compatible server in a process that may run AMX tile instructions.

    python -m eval.vllm_server ARGS      (ARGS: those of `python -m vllm.entrypoints.openai.api_server`)

It runs vLLM's own api_server module with the same arguments; importing this module first asks for the AMX tile
state (`vllm_run.allow_amx`), here and in every engine and worker process vLLM spawns, which import this module
as their main one. The main module stays this one (`alter_sys` off) so that they do.
"""

from __future__ import annotations

import runpy

from .child import watch_parent
from .vllm_run import allow_amx

if __name__ in ("__main__", "__mp_main__"):  # this server's process or one vLLM spawned: see allow_amx
    allow_amx()

if __name__ == "__main__":
    watch_parent()  # before vLLM starts its engine: the group dies with whoever started this server
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
