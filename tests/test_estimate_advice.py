"""What would make a configuration fit (memfit.estimate.advice), as a user meets it: `memfit
estimate` and `memfit fit` print the single changes the estimator itself finds, and each printed
flag, passed back to the CLI, gives what the advice promised; `memfit estimate` with lists ranks
the combinations by the workflow's own selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.estimate import estimate, fit_main, main
from memfit.estimate.advice import advise, advise_fit, needs_advice
from memfit.estimate.models import catalog
from memfit.estimate.selection import choose, judge
from memfit.space import Candidate

# Llama-3.1-8B LoRA on an RTX 4090 (the example): 8,192 tokens do not fit
LORA_4090 = ["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--finetune", "lora"]


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


# -- the module, without the CLI -----------------------------------------------------------------


def test_advise_lists_only_single_changes_that_fit_fastest_first():
    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("rtx4090")
    cand = Candidate(zero=0, grad_ckpt=True, attn="flash", finetune="lora", ref=None, seq_len=8192)

    def price(c):
        return estimate(arch, gpu, 1, 1, "sft", c, headroom=None)

    base = price(cand)
    assert not base.fits_with_headroom and needs_advice(base)
    options = advise(price, cand, base, arch, world=1, method="sft")
    flags = [o.flags for o in options]
    assert "--loss-impl chunked" in flags
    assert any(f.startswith("--seq-len ") for f in flags)
    for o in options:
        assert o.estimate.fits_with_headroom and o.estimate == price(o.cand)
        changed = {k for k, v in o.cand.to_dict().items() if v != getattr(cand, k)}
        assert len(changed - {"zero", "offload_optimizer", "offload_param", "ref", "grad_accum"}) <= 1
    speeds = [o.estimate.tokens_per_s for o in options]
    assert speeds == sorted(speeds, reverse=True)
    # the shorter sequence is the longest that fits: one token more does not
    n = int(next(f for f in flags if f.startswith("--seq-len ")).split()[1])
    assert not price(Candidate(**{**cand.to_dict(), "seq_len": n + 1})).fits_with_headroom


def test_a_configuration_with_room_to_spare_gets_no_advice():
    arch, gpu = catalog.model("qwen2.5-0.5b"), catalog.gpu("h100-80gb")
    cand = Candidate(zero=0, grad_ckpt=True, attn="flash", seq_len=1024)
    base = estimate(arch, gpu, 1, 1, "sft", cand, headroom=None)
    assert base.fits_with_headroom and not needs_advice(base)


def test_advise_fit_keeps_the_levers_that_reach_further():
    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("rtx4090")
    cand = Candidate(zero=0, grad_ckpt=True, attn="flash", finetune="lora", ref=None)

    def search(c):
        from memfit.estimate.search import largest_fitting

        return largest_fitting(
            lambda n: estimate(arch, gpu, 1, 1, "sft", Candidate(**{**c.to_dict(), "seq_len": n}), headroom=None),
            2,
            131072,
        )

    best, _ = search(cand)
    options = advise_fit(search, cand, "seq_len", best, arch, world=1, method="sft")
    assert options and all(o.value > best for o in options)
    assert [o.value for o in options] == sorted((o.value for o in options), reverse=True)
    assert {"--loss-impl chunked", "--finetune qlora"} <= {o.flags for o in options}


# -- the CLI --------------------------------------------------------------------------------------


def test_estimate_prints_what_would_make_it_fit_and_the_flags_work(capsys):
    assert main([*LORA_4090, "--seq-len", "8192"]) == 1
    out = capsys.readouterr().out
    head = out.index("would make it fit (one change from this configuration each")
    advice = [ln.strip() for ln in out[head:].splitlines()[1:] if ln.startswith("  ")]
    assert advice and any(ln.startswith("--loss-impl chunked ") for ln in advice)
    assert out.index("verdict: DOES NOT FIT") < head
    for line in advice:
        flags = line.split(" peak ")[0].split()
        assert main([*LORA_4090, "--seq-len", "8192", *flags]) == 0, line  # the printed flags fit
        capsys.readouterr()


def test_estimate_json_carries_the_advice(capsys):
    assert main([*LORA_4090, "--seq-len", "8192", "--json"]) == 1
    out = _json(capsys)
    assert out["advice"] and all(o["device_total_bytes"] <= o["usable_device_bytes"] for o in out["advice"])
    assert {"flags", "step_time_s", "tokens_per_s", "throughput_change", "candidate"} <= set(out["advice"][0])
    assert main([*LORA_4090, "--seq-len", "8192", "--no-advice"]) == 1
    assert "would make it fit" not in capsys.readouterr().out


def test_fit_says_how_far_each_lever_reaches(capsys):
    """The issue's example: fit answers a short length and says what chunked loss and QLoRA reach;
    each figure is what `memfit fit` answers with that flag."""
    assert fit_main(["--maximize", "seq_len", *LORA_4090]) == 0
    out = capsys.readouterr().out
    best = int(out.splitlines()[0].rsplit(": ", 1)[1])
    reach = {}
    for line in out.splitlines():
        if line.startswith("  with "):
            flags, value = line[len("  with ") :].split(": ", 1)
            reach[flags] = int(value.split()[0].replace(",", ""))
    assert reach["--loss-impl chunked"] > best and reach["--finetune qlora"] > best
    assert fit_main(["--maximize", "seq_len", *LORA_4090, "--loss-impl", "chunked", "--json"]) == 0
    chunked = _json(capsys)
    assert chunked["seq_len"] == reach["--loss-impl chunked"]
    # --json's configuration is the answer's: its length, the lever given, the defaults taken
    assert chunked["configuration"]["candidate"]["seq_len"] == chunked["seq_len"]
    assert chunked["configuration"]["candidate"]["loss_impl"] == "chunked"
    assert "--seq-len" not in chunked["configuration"]["defaults_taken"]


RANKED = ["--model", "qwen2-7b", "--gpu", "a100-80gb", "--num-gpus", "8", "--seq-len", "4096"]
LISTS = ["--zero", "0,2,3", "--grad-ckpt", "on,off", "--micro-batch", "1,2"]


def test_lists_rank_the_cross_product_by_the_workflow_selection(capsys):
    assert main([*RANKED, *LISTS, "--json"]) == 0
    out = _json(capsys)
    rows = out["candidates"]
    assert len(rows) == 12 and out["selected"] == rows[0]["id"]
    # the same rows judged and chosen by memfit.estimate.selection give the same answer
    priced = []
    for r in rows:
        c = r["candidate"]
        argv = [*RANKED, "--zero", str(c["zero"]), "--micro-batch", str(c["micro_batch"]), "--json"]
        argv.append("--grad-ckpt" if c["grad_ckpt"] else "--no-grad-ckpt")
        main(argv)
        one = _json(capsys)
        assert one["device_total_bytes"] == r["predicted"]["device_total_bytes"]
        assert one["fits_with_headroom"] == r["fits"]
        priced.append({**one, "candidate": c, "id": r["id"]})
    from memfit.estimate.rows import Budget

    b = out["budget"]
    budget = Budget(b["device_bytes"], b["host_bytes"], b["headroom"], b["headroom_source"])
    best, _ = choose(judge(priced, {}, budget, 8, "sft"), budget)
    assert best.id == out["selected"]


def test_the_ranked_table_shows_fits_peak_step_and_throughput(capsys):
    assert main([*RANKED, *LISTS]) == 0
    out = capsys.readouterr().out
    assert "ranked by the workflow's selection" in out and "tokens/s" in out
    rows = [ln for ln in out.splitlines() if ln[:6].strip().isdigit()]
    assert len(rows) == 12 and "selected: fastest that fits" in rows[0]
    assert out.splitlines()[-1].startswith("selected: z")


def test_a_list_of_one_value_is_the_single_configuration(capsys):
    main([*RANKED, "--zero", "3", "--json"])
    single = _json(capsys)
    assert "candidates" not in single and single["configuration"]["candidate"]["zero"] == 3


def test_nothing_fits_exits_1_and_names_the_closest(capsys):
    argv = ["--model", "qwen2.5-72b", "--gpu", "rtx4090", "--zero", "0,3", "--finetune", "full,lora"]
    assert main(argv) == 1
    assert "nothing fits: no candidate fits the budget (4 candidates); the closest," in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--zero", "0,5"], "argument --zero: '5' is not one of 0, 1, 2, 3"),
        (["--micro-batch", "1,,2"], "argument --micro-batch: '1,,2': an empty value in the list"),
        (["--grad-ckpt", "on,maybe"], "argument --grad-ckpt: 'maybe' is not a valid value"),
    ],
)
def test_a_bad_list_value_names_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*RANKED, *argv])
    assert exc.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--micro-batch", "0,2"], "--micro-batch must be > 0, got 0"),
        (["--sequence-parallel", "0,2"], "--sequence-parallel must be > 0, got 0"),
        (
            ["--zero", "0,2", "--offload-param", "cpu"],
            "no combination of the lists can run: invalid candidate: parameter offload (offload_param=cpu) needs ZeRO-3",
        ),
    ],
)
def test_a_bad_value_in_a_list_is_refused_before_estimating(argv, words, capsys):
    assert main([*RANKED, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"memfit estimate: error: {words}") and captured.err.count("\n") == 1
    assert captured.out == ""  # nothing half-written


def test_a_flag_that_does_nothing_in_every_combination_is_refused(capsys):
    argv = [*RANKED, "--zero", "2,3", "--lora-rank", "8"]
    assert main(argv) == 2
    assert "--lora-rank does nothing with --finetune full" in capsys.readouterr().err
    assert main([*argv, "--finetune", "full,lora"]) == 0  # it does something for the LoRA ones
    capsys.readouterr()


def test_fit_refuses_lists(capsys):
    assert fit_main(["--maximize", "seq_len", *LORA_4090, "--zero", "0,3"]) == 2
    err = capsys.readouterr().err
    assert "memfit fit takes one value per flag, got a list for --zero" in err and err.count("\n") == 1


def test_a_fit_with_little_room_gets_the_levers_that_make_room(capsys):
    """At the longest length that fits (fit's answer) less than 5% of the usable memory is left:
    the levers that lower the peak are listed, each lower than the configuration's own."""
    fit_main(["--maximize", "seq_len", *LORA_4090, "--json"])
    longest = _json(capsys)
    assert main([*LORA_4090, "--seq-len", str(longest["seq_len"]), "--json"]) == 0
    out = _json(capsys)
    assert out["fits_with_headroom"] and out["advice"]
    assert all(o["device_total_bytes"] < out["device_total_bytes"] for o in out["advice"])
    main([*LORA_4090, "--seq-len", str(longest["seq_len"])])
    assert "would make more room (one change from this configuration each" in capsys.readouterr().out


def test_a_traced_estimate_reports_progress_on_stderr_unless_json_or_quiet(tmp_path, monkeypatch, capsys):
    """A model being traced says so on stderr, a line per traced shape (the tracer's hook,
    memfit.estimate.trace.trace.progress_to); --json (and --quiet) keep it silent."""
    from memfit.estimate.trace import trace

    if not hasattr(trace, "progress_to"):
        pytest.skip("this tracer has no progress hook")
    monkeypatch.setenv("MEMFIT_TRACE_IN_PROCESS", "1")  # the tiny model traces faster than a child starts
    tiny = Path(__file__).resolve().parents[1] / "config" / "models" / "demo-tiny.json"
    argv = ["--model", str(tiny), "--gpu", "cpu", "--attn", "sdpa", "--activations", "traced", "--seq-len", "64"]
    main([*argv, "--trace-cache", str(tmp_path / "a"), "--json"])  # --quiet takes the same path
    assert "memfit estimate:" not in capsys.readouterr().err
    main([*argv, "--trace-cache", str(tmp_path / "b")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memfit estimate: ")]
    assert any(line.startswith("memfit estimate: tracing ") for line in err)
    assert any("64 tokens" in line for line in err)


def test_more_gpus_names_the_fewest_of_the_same_kind_that_fit(capsys):
    """Qwen2.5-72B full SFT does not fit one H100: the line names the fewest H100s (8 a node, the
    catalog's node) that fit, at ZeRO-3; those flags fit, one node fewer does not."""
    argv = ["--model", "qwen2.5-72b", "--gpu", "h100-80gb"]
    assert main(argv) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("or with more GPUs"))
    flags = line.split(": ", 1)[1].split("  peak ")[0].split()
    assert flags[:2] == ["--num-gpus", "8"] and flags[-2:] == ["--zero", "3"]
    nodes = int(flags[flags.index("--num-nodes") + 1])
    assert main([*argv, *flags]) == 0
    fewer = [*argv, "--num-gpus", "8", "--zero", "3"] + (["--num-nodes", str(nodes - 1)] if nodes > 2 else [])
    assert main(fewer) == 1
    capsys.readouterr()
    main([*argv, "--json"])
    assert _json(capsys)["more_gpus"]["flags"] == " ".join(flags)


def test_global_batch_makes_every_ranked_configuration_train_the_same_batch(capsys):
    """--global-batch as the workflow's train.global_batch: each combination's grad accum trains
    it; a micro batch that cannot make it on 8 ranks is skipped, named."""
    assert main([*RANKED, "--micro-batch", "1,2,4", "--global-batch", "16", "--json"]) == 0
    out = _json(capsys)
    assert {r["candidate"]["micro_batch"] * r["candidate"]["grad_accum"] * 8 for r in out["candidates"]} == {16}
    assert len(out["candidates"]) == 2
    assert out["skipped"] == [
        "--micro-batch 4: --global-batch 16 is not a multiple of --micro-batch 4 x 8 data-parallel ranks"
    ]
    assert main([*RANKED, "--global-batch", "16", "--grad-accum", "2"]) == 2
    assert "give --global-batch or --grad-accum, not both" in capsys.readouterr().err
