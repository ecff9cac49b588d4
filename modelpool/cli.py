"""The `modelpool` command line."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from modelpool.config import FleetFileError, load_fleet

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Serve many LLMs from one GPU pool; simulate and plan its capacity.")
err = Console(stderr=True)
out = Console()

FLEET = typer.Option(Path("models.yaml"), "--fleet", "-f", help="Fleet file (models.yaml).")


@app.command()
def validate(
    target: str = typer.Argument("models.yaml", help="Fleet file to check, or a scenario to validate the "
                                 "simulator on (sims.scenarios: eight-poisson, mixed-onoff, large-azure-conv, "
                                 "small-azure-code, ...)."),
    profile: str | None = typer.Option(None, "--profile", help="Scenario: the calibration profile to simulate and "
                                       "serve with (`modelpool calibrate`; default: the cost model's own)."),
    duration: float | None = typer.Option(None, "--duration", help="Scenario: seconds of arrivals per load "
                                          "(default 60; 8 with --quick)."),
    quick: bool = typer.Option(False, "--quick", help="Scenario: a short smoke run (light load only)."),
    load: list[str] = typer.Option([], "--load", help="Scenario: light | knee (repeatable; default both)."),
    rate: float | None = typer.Option(None, "--rate", help="Scenario: this total req/s instead of the loads' "
                                      "fractions of the simulated knee."),
    out_dir: Path = typer.Option(Path("out/validate"), "--out", help="Scenario: where the comparison JSON, the "
                                 "models and the server log go."),
    seed: int = typer.Option(0, "--seed", help="Scenario: the workload's seed."),
    knee: float | None = typer.Option(None, "--knee", help="Scenario: the knee rate (req/s) the loads are "
                                      "fractions of, instead of searching it with the simulator."),
    max_output: int | None = typer.Option(None, "--max-output", help="Scenario: clip outputs to this many "
                                          "tokens (default: the scenario's own limit)."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help="Scenario: seconds a replayed "
                                          "request may take before it counts as failed."),
    from_live: Path | None = typer.Option(None, "--from-live", help="Scenario: simulate again the live run "
                                          "recorded in this JSON (a validate output), e.g. with another --profile; "
                                          "nothing is served."),
) -> None:
    """Check a fleet file (print every problem with file:line:column and field), or serve a scenario on this
    machine, replay it through the gateway, simulate the same requests and print both side by side."""
    from sims.scenarios import SCENARIOS

    if target in SCENARIOS:
        from modelpool.validate import format_report, validate_scenario
        from sims.workload import TraceError

        try:
            if from_live is not None:
                from modelpool.validate import resimulate

                typer.echo(format_report(resimulate(from_live, profile, out_dir)))
                return
            report = validate_scenario(target, profile, duration, quick, load or (["light"] if quick else
                                                                                   ["light", "knee"]),
                                       rate, out_dir, seed, request_timeout_s=request_timeout, knee=knee,
                                       max_output=max_output)
        except TraceError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(format_report(report))
        return
    path = Path(target)
    if not path.exists() and not target.endswith((".yaml", ".yml")):
        typer.echo(f"error: {target!r} is neither a fleet file nor a scenario (scenarios: "
                   f"{', '.join(SCENARIOS)})", err=True)
        raise typer.Exit(2)
    try:
        fleet = load_fleet(path)
    except FleetFileError as exc:
        for problem in exc.problems:
            typer.echo(str(problem), err=True)
        typer.echo(f"{len(exc.problems)} problem(s) in {path}", err=True)
        raise typer.Exit(1) from None
    gpu = fleet.gpu()
    table = Table(title=f"{path}: {len(fleet.models)} models on {fleet.pool.num_gpus} x {fleet.pool.gpu}")
    for column in ("model", "arch", "params", "tp", "weights GB/GPU", "KV KB/token", "TTFT/TPOT SLO", "rate req/s"):
        table.add_column(column)
    for entry in fleet.models:
        slo = fleet.slo(entry)
        table.add_row(entry.name, entry.arch_name or entry.arch.family, f"{entry.arch.params / 1e9:.1f}B", str(entry.tp),
                      f"{entry.arch.weight_bytes / entry.tp / 1e9:.1f}", f"{entry.arch.kv_bytes_per_token / 1024:.0f}",
                      f"{slo.ttft_s:g} s / {slo.tpot_s * 1000:g} ms",
                      f"{entry.traffic.rate_rps:.4f}" if entry.traffic else "-")
    out.print(table)
    out.print(f"OK: {path} is valid ({gpu.memory_gb:g} GB per {fleet.pool.gpu.upper()}).")


@app.command()
def schema() -> None:
    """Print the JSON Schema of models.yaml (for editors: yaml-language-server)."""
    from scheduler.fleet import Fleet

    doc = Fleet.model_json_schema()
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = "modelpool fleet (models.yaml)"
    # `arch` may also be a catalogue key or a folder path; the loader resolves those to objects
    models = doc["$defs"]["ModelEntry"]["properties"]
    models["arch"] = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/Arch"}], "description": models["arch"]["description"]}
    typer.echo(json.dumps(doc, indent=2))


from modelpool.calibrate import calibrate_command  # noqa: E402
from modelpool.capacity import capacity_command  # noqa: E402
from modelpool.estimate import estimate_command  # noqa: E402
from modelpool.serve import serve_command  # noqa: E402
from modelpool.simulate import simulate_command  # noqa: E402
from modelpool.traces import app as traces_app  # noqa: E402

app.command("simulate")(simulate_command)
app.command("estimate")(estimate_command)
app.command("capacity")(capacity_command)
app.command("serve")(serve_command)
app.command("calibrate")(calibrate_command)
app.add_typer(traces_app, name="traces")

if __name__ == "__main__":
    app()
