"""`gpus: [detect]`: this machine's GPU, by nvidia-smi's name and memory, as a catalog name."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from memfit.estimate.models.detect import DetectError, detect_gpu, gpu_for_device
from memfit.workflow.config import ConfigError, WorkflowConfig

REPO = Path(__file__).resolve().parents[1]

# (what nvidia-smi prints as name, memory.total in MiB) -> catalog name; names and sizes as
# nvidia-smi prints them on current drivers (config/gpus.yaml cites a log for each memory_mib)
SMI = [
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
    ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 40960, "a100-40gb"),  # no 40 GB PCIe entry: the memory decides
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-80gb-pcie"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx4090"),
    ("NVIDIA GeForce RTX 3090", 24576, "rtx3090"),
    ("Tesla V100-SXM2-16GB", 16384, "v100-16gb"),
    ("Tesla V100-SXM2-32GB", 32768, "v100-32gb"),
    ("NVIDIA L40S", 46068, "l40s"),
    ("NVIDIA A10", 23028, "a10"),
    ("NVIDIA A10G", 23028, "a10g"),
    ("Tesla T4", 15360, "t4"),
    ("NVIDIA RTX A6000", 49140, "a6000"),
    ("NVIDIA L4", 23034, "l4"),
    ("NVIDIA B200", 183359, "b200"),
]


@pytest.mark.parametrize(("name", "mib", "expected"), SMI)
def test_each_product_nvidia_smi_names_is_its_catalog_entry(name, mib, expected):
    assert gpu_for_device(name, mib) == expected


def test_a_gpu_the_catalog_lacks_is_refused_with_the_names_to_use():
    with pytest.raises(DetectError, match=r"no catalog GPU for 'NVIDIA GeForce RTX 4080'.*h100-80gb"):
        gpu_for_device("NVIDIA GeForce RTX 4080", 16376)
    # a sibling of a known card with other memory is not given that card's budget
    with pytest.raises(DetectError, match=r"'NVIDIA H100 NVL' \(95830 MiB\): the nearest, h100-pcie, has 81559 MiB"):
        gpu_for_device("NVIDIA H100 NVL", 95830)


def _fake_smi(tmp_path: Path, monkeypatch, lines: list[str]) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_detect_reads_nvidia_smi_and_respects_cuda_visible_devices(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, ["0, NVIDIA H100 80GB HBM3, 81559", "1, NVIDIA A100-SXM4-40GB, 40960"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert detect_gpu() == "h100-80gb"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(DetectError, match="several kinds"):
        detect_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CUDA sees no GPU: neither does detect
    with pytest.raises(DetectError, match="lists no GPU"):
        detect_gpu()


def _demo_config() -> dict:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_the_workflow_config_resolves_detect_to_the_catalog_name(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, ["0, NVIDIA H200, 143771"])
    raw = _demo_config() | {"gpus": ["detect"], "num_gpus": 1}
    cfg = WorkflowConfig.load(raw)
    assert cfg.gpus == ["h200"] and raw["gpus"] == ["h200"]  # in place: the {gpu} wildcard is the name


def test_detect_on_a_machine_without_a_gpu_names_the_key_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    with pytest.raises(
        ConfigError, match=r"gpus\[0\]: gpus: \[detect\] found no NVIDIA GPU.*--config 'gpus=\[h100-80gb\]'"
    ):
        WorkflowConfig.load(_demo_config() | {"gpus": ["detect"]})
