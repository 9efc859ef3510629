"""memfit.report.run_summary: what a workflow run proved, as one JSON (benchmarks/gpu_check.sh).
The whole of it runs in CI on the demo's results (.ci/run); here, Snakemake's log as it reads it."""

from __future__ import annotations

from memfit.report.run_summary import snakemake_jobs, summarize

# Snakemake 9.27's own log of a run stopped by a failing train job (rule blocks as it prints them)
LOG = """\
Building DAG of jobs...
Job stats:
job                    count
-------------------  -------
build_demo_model           1
train                      2
verify_resume              2
report                     1
all                        1
total                      7

Select jobs to execute...
[Fri Nov 27 11:25:49 2026]
localrule build_demo_model:
    input: config/models/demo-gpu.json
    output: resources/demo-gpu
    jobid: 4
    reason: Missing output files: resources/demo-gpu
    wildcards: model=demo-gpu
    resources: tmpdir=/tmp, runtime=15

[Fri Nov 27 11:26:28 2026]
Finished jobid: 4 (Rule: build_demo_model)
1 of 7 steps (14%) done
[Fri Nov 27 11:26:30 2026]
rule train:
    input: results/demo-gpu/h200/sft/run.json
    output: results/demo-gpu/h200/sft/train/summary.json
    log: logs/demo-gpu/h200/sft/train.log
    jobid: 9
    wildcards: model=demo-gpu, gpu=h200, method=sft
    resources: tmpdir=/tmp

[Fri Nov 27 11:29:48 2026]
Error in rule train:
    message: None
    jobid: 9
    input: results/demo-gpu/h200/sft/run.json
    output: results/demo-gpu/h200/sft/train/summary.json
    log: logs/demo-gpu/h200/sft/train.log (check log file(s) for error details)

Shutting down, this might take some time.
"""


def test_each_job_has_its_rule_wildcards_status_and_seconds():
    jobs = snakemake_jobs(LOG)
    assert jobs["jobs"] == [
        {"jobid": 4, "rule": "build_demo_model", "status": "done", "wildcards": {"model": "demo-gpu"}, "seconds": 39},
        {
            "jobid": 9,
            "rule": "train",
            "status": "failed",
            "wildcards": {"model": "demo-gpu", "gpu": "h200", "method": "sft"},
            "seconds": 198,
        },
    ]
    assert jobs["planned"] == {"build_demo_model": 1, "train": 2, "verify_resume": 2, "report": 1}


def test_a_run_that_stopped_early_is_not_ok_and_says_what_did_not_finish(tmp_path):
    log = tmp_path / "run.snakemake.log"
    log.write_text(LOG)
    doc = summarize(tmp_path / "results", log)
    assert doc["ok"] is False and doc["runs"] == [] and doc["report"] is None
    assert doc["not_finished"] == [
        "report (not started)",
        "train (failed)",
        "train (not started)",
        "verify_resume (not started)",
    ]


def test_a_job_still_running_when_the_run_was_cut_is_reported_as_such():
    cut = LOG.split("[Fri Nov 27 11:29:48 2026]")[0]  # the deadline came during training
    job = snakemake_jobs(cut)["jobs"][-1]
    assert (job["rule"], job["status"], job["seconds"]) == ("train", "running", None)
