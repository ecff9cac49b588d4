"""serve's demo on a GPU costs plans with the catalogue GPU it runs on, named or detected - never a silent guess."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from modelpool.cli import app
from modelpool.gpus import gpu_key


def test_a_detected_gpu_maps_to_its_catalogue_key() -> None:
    assert gpu_key(None, lambda: "NVIDIA H200") == "h200"
    assert gpu_key(None, lambda: "NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gpu_key("H20", lambda: "NVIDIA H200") == "h20"  # --gpu wins over the device


def test_an_unknown_gpu_is_an_error_naming_it_and_the_known_ones() -> None:
    with pytest.raises(typer.BadParameter, match=r"GPU 'NVIDIA L40S' is not in the catalogue \(known: h20, .*h200"):
        gpu_key(None, lambda: "NVIDIA L40S")
    with pytest.raises(typer.BadParameter, match=r"unknown GPU type 'l40s'; known: h20"):
        gpu_key("l40s")

    def no_device() -> str:
        raise RuntimeError("no CUDA device")

    with pytest.raises(typer.BadParameter, match=r"cannot read this machine's GPU name .*--gpu KEY"):
        gpu_key(None, no_device)


def test_serve_refuses_a_bad_gpu_before_starting_anything() -> None:
    res = CliRunner().invoke(app, ["serve", "--gpu", "l40s"])
    assert res.exit_code == 2 and "unknown GPU type 'l40s'" in res.output
    res = CliRunner().invoke(app, ["serve", "--gpu", "h200", "--fleet", "models.yaml"])
    assert res.exit_code == 2 and "--gpu is for the demo fleet" in res.output


def test_a_fleet_for_a_bigger_gpu_than_this_one_is_refused_before_anything_starts(tmp_path) -> None:
    """A fleet planned for an h200 served on an H100: the plan (weights region, KV, arenas) would run out of memory
    part-way through start-up, so serve refuses it naming both GPUs and the key to use."""
    from pathlib import Path

    from modelpool.gpus import check_gpu_memory

    h100 = ("NVIDIA H100 80GB HBM3", int(79.18 * 2**30))
    with pytest.raises(typer.BadParameter, match=r"fleet.yaml: pool.gpu is 'h200' \(141 GB\), but this machine's "
                                                 r"GPU 0 is NVIDIA H100 80GB HBM3 with 85.0 GB.*\('h100'\)"):
        check_gpu_memory("h200", 141, Path("fleet.yaml"), lambda: h100)
    with pytest.raises(typer.BadParameter, match=r"describe this GPU in the fleet's `gpus:`"):
        check_gpu_memory("h200", 141, Path("fleet.yaml"), lambda: ("NVIDIA L40S", 48 << 30))
    check_gpu_memory("h100", 80, Path("fleet.yaml"), lambda: h100)  # its own type fits
    check_gpu_memory("h20", 96, Path("fleet.yaml"), lambda: ("NVIDIA H200", 143 << 30))  # a bigger card: fine
    check_gpu_memory("h200", 141, Path("fleet.yaml"), lambda: None)  # no CUDA here (a Ray head without GPUs)
