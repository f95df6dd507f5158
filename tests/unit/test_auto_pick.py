"""How `method: auto` picks its winner from the candidates' held-out KLs."""

import pytest

from pipeline.auto import AutoError, pick


def _row(method, kl):
    return {"method": method, "kl_mean": kl, "problem": None if kl is not None else "its held-out KL is nan"}


def test_the_lowest_held_out_kl_wins_and_a_tie_or_an_invalid_score_is_said():
    assert pick([_row("awq", 0.02), _row("gptq", 0.01), _row("rtn", 0.05)]) == ("gptq", "lowest held-out KL")
    chosen, why = pick([_row("awq", 0.01), _row("gptq", 0.01), _row("rtn", None)])
    assert chosen == "awq" and "tied between awq, gptq" in why and "not ranked: rtn" in why
    with pytest.raises(AutoError, match="no candidate has a finite held-out KL"):
        pick([_row("awq", None)])
