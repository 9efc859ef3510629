"""A refusal raised in a rank is printed once, without the traceback, whether or not the rank had
joined the process group (torch.distributed's excepthook prefixes each line with "[rankN]: ")."""

from __future__ import annotations

import io

import pytest

from memfit.train.rank_output import RankOutput

TRACE = [
    "Traceback (most recent call last):\n",
    '  File "loop.py", line 1, in setup\n',
    "memfit.train.run_config.RunRefused: data_dir d was prepared for orpo (its stats.json), whose rows\n",
    "kto cannot train on; prepare the data with method kto\n",
]


@pytest.mark.parametrize("prefix", ["", "[rank0]: "], ids=["before the process group", "in the process group"])
def test_a_refusal_prints_its_message_only(prefix):
    out, err = io.StringIO(), io.StringIO()
    ranks = RankOutput(out, err)
    pipe = io.BytesIO(("step 1\n" + "".join(prefix + line for line in TRACE)).encode())
    ranks.attach(pipe)
    ranks.join()
    assert ranks.refused
    assert out.getvalue() == "step 1\n"
    said = err.getvalue()
    assert "was prepared for orpo" in said and "prepare the data with method kto" in said
    assert "Traceback" not in said and "[rank0]" not in said


def test_another_error_keeps_its_traceback():
    out, err = io.StringIO(), io.StringIO()
    ranks = RankOutput(out, err)
    lines = ["[rank1]: Traceback (most recent call last):\n", "[rank1]: ValueError: boom\n"]
    ranks.attach(io.BytesIO("".join(lines).encode()))
    ranks.join()
    assert not ranks.refused
    assert "[rank1]: ValueError: boom" in err.getvalue()
