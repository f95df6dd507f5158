"""bench/reference_load.py refuses, with one line and exit 2, what it cannot time."""

import pytest
import torch

from bench import reference_load


@pytest.mark.skipif(torch.cuda.is_available(), reason="this box has a GPU: the bench would run")
def test_without_a_gpu_it_says_where_to_run_it(tmp_path, capsys):
    assert reference_load.main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA device") and err.count("\n") == 1


def test_the_two_loads_compare_every_parameter_and_buffer(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    names = reference_load.tensors(model)
    assert {n for n in names if n.startswith("param:")} == {f"param:{n}" for n, _ in model.named_parameters()}
    assert any(n.startswith("buffer:") and "inv_freq" in n for n in names)
