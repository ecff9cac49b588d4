"""serve's demo on a GPU costs plans with the catalogue GPU it runs on, named or detected - never a silent guess."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from modelpool.cli import app
from modelpool.serve import gpu_key


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
