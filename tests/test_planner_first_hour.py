"""The capacity planner's first hour (issue 38), run as a user runs it: `modelpool simulate`, `capacity`,
`estimate` and `traces fetch` through the CLI, each checked on the message or figure it prints."""

from __future__ import annotations

import html
import pathlib
import shutil

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from tests.sims.test_capacity import TINY_FLEET

HEADER = "timestamp_s,model,input_tokens,output_tokens\n"


@pytest.fixture()
def tiny_fleet(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_FLEET)
    return path


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


def flat(output: str) -> str:
    """The words of `output` in order, table borders and line wraps gone (rich wraps at 80 columns here)."""
    return " ".join(output.replace("│", " ").split())


# ---- 1: a model name the fleet does not know ------------------------------------------------------------------


def test_a_misspelt_model_name_is_an_error_naming_file_line_and_the_fleets_names(
        tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    names = ["small-a", "small-b", "small-c"]
    rows = [f"{k * 0.5},{names[k % 3]},100,10" for k in range(200)]
    rows[137] = "68.5,small-bb,100,10"  # one typo among 200 rows (line 139: the header is line 1)
    trace = tmp_path / "trace.csv"
    trace.write_text(HEADER + "\n".join(rows) + "\n")
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", str(trace))
    assert code == 1
    assert (f"{trace}:139: column 'model': not a model of the fleet (did you mean 'small-b'? the fleet's 3 models: "
            "small-a, small-b, small-c. To deal the file's models onto the fleet by popularity instead, add ;map=fold "
            "to the trace spec (the mapping is printed)): 'small-bb'") in flat(output)
    code, output = invoke("capacity", "--fleet", str(tiny_fleet), "--trace", str(trace), "--workers", "0")
    assert code == 1 and f"{trace}:139: column 'model'" in output and "'small-bb'" in output
    # the same in JSONL: the line of the row
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text("".join(f'{{"timestamp_s": {k}, "model": "{"smal-a" if k == 3 else "small-a"}", '
                             f'"input_tokens": 10, "output_tokens": 2}}\n' for k in range(6)))
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", str(jsonl))
    assert code == 1 and f"{jsonl}:4: column 'model': not a model of the fleet (did you mean 'small-a'?" in flat(output)


def test_a_single_model_file_with_a_misspelt_name_is_refused_not_spread_over_the_fleet(
        tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    trace = tmp_path / "one.csv"  # every row names the same model, misspelt: nothing of the fleet's is named
    trace.write_text(HEADER + "".join(f"{k},small_c,50,5\n" for k in range(30)))
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", str(trace))
    assert code == 1
    assert (f"{trace}: none of the file's 1 model names is a model of the fleet ('small_c'; the fleet's 3 models: "
            "small-a, small-b, small-c. To deal the file's models onto the fleet by popularity instead, add ;map=fold")\
        in flat(output)


def test_a_trace_of_other_models_is_mapped_only_when_asked_and_the_mapping_printed_with_counts(
        tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    trace = tmp_path / "other.csv"
    trace.write_text(HEADER + "".join(f"{k},{'busy' if k % 3 else 'quiet'},50,5\n" for k in range(30)))
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", str(trace))
    assert code == 1 and "none of the file's 2 model names is a model of the fleet ('quiet', 'busy';" in flat(output)
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", f"{trace};map=fold")
    assert code == 0, output
    assert ("note: 2 trace models dealt round-robin by popularity onto 3 models (requests of each trace model): "
            "busy (20) -> small-a, quiet (10) -> small-b") in flat(output)
    # the explicit option deals a file that names some fleet models too, and says so
    trace.write_text(HEADER + "".join(f"{k},{'small-a' if k % 3 else 'smal-b'},50,5\n" for k in range(30)))
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", f"{trace};map=fold")
    assert code == 0, output
    assert "small-a (20) -> small-a, smal-b (10) -> small-b" in flat(output)
    # a file read only for its lengths may name anything
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace",
                          f"poisson;rate=1;duration=20;lengths=file:{trace}")
    assert code == 0, output


def test_a_public_traces_assignment_to_the_fleet_is_in_the_capacity_report(
        tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    import json

    rows = tmp_path / "vidur.csv"  # a single-model public format (no fleet names): split at random, and said so
    rows.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(f"{k},50,5\n" for k in range(40)))
    out = tmp_path / "report"
    code, output = invoke("capacity", "--fleet", str(tiny_fleet), "--trace", str(rows), "--workers", "0",
                          "--policies", "dedicated", "--what-if-tpot", "0", "--out", str(out))
    assert code == 0, output
    note = "40 requests of 'vidur' mapped at random onto 3 models (requests each): small-a ("
    assert f"note: {note}" in flat(output)
    report = json.loads((out / "report.json").read_text())
    assert report["notes"][0].startswith(f"workload: {note}")
    assert f"- workload: {note}" in (out / "report.md").read_text()


# ---- 3: "(unmet)" says who missed; savings against a failing baseline say so ------------------------------------


def test_unmet_names_the_policy_and_the_models_that_missed(tmp_path: pathlib.Path) -> None:
    fleet = tmp_path / "tight.yaml"  # small-c's 2 ms TPOT SLO cannot be met on an H20
    fleet.write_text(TINY_FLEET.replace("rate_rps: 0.1}}", "rate_rps: 0.1}, slo: {ttft_s: 10, tpot_s: 0.002}}"))
    out = tmp_path / "report"
    code, output = invoke("capacity", "--fleet", str(fleet), "--duration", "60", "--workers", "0",
                          "--what-if-tpot", "0", "--policies", "dedicated,token-level", "--out", str(out))
    assert code == 0, output
    assert ("(unmet) dedicated misses the 99.0% per-request target (each model must meet it on its own); "
            "under it: small-c 0.00%") in output
    assert "(unmet) token-level misses the 99.0% per-request target (each TP class must meet it over its requests); " \
           "under it: small-c 0.00%" in output
    assert "small-a" not in output.split("(unmet) dedicated")[1].split("\n")[0]  # only the model that missed
    assert "Target not met: dedicated misses the 99.0% per-request target" in (out / "report.md").read_text()
    assert "Target not met: dedicated misses" in (out / "report.html").read_text()


def test_savings_against_a_baseline_that_missed_its_own_target_say_so() -> None:
    from types import SimpleNamespace

    from sims.capacity import Goal
    from sims.report import _headline

    result = SimpleNamespace(gpu="h20", config=SimpleNamespace(goal=Goal(0.99)))
    missed = [{"model": "qwen3-32b-chat", "attainment": 0.97, "requests": 40}]
    policies = {"dedicated": {"gpus": 23, "usd_per_month": 30_000.0, "met": False, "missed_models": missed},
                "token-level": {"gpus": 17, "usd_per_month": 22_000.0, "met": True, "missed_models": []}}
    headline = _headline(result, None, policies)
    assert headline["sentence"].startswith("23 dedicated H20s -> 17 pooled (token-level), 26% fewer GPUs")
    assert headline["baseline_met"] is False
    assert ("but the dedicated baseline misses the target itself (qwen3-32b-chat under it), so this saving is "
            "measured against a pool that falls short") in headline["sentence"]
    policies["dedicated"]["met"] = True
    assert "baseline" not in _headline(result, None, policies)["sentence"]


# ---- 5: a profile measured on one device, simulated on another ------------------------------------------------


def calibrated_profile(tmp_path: pathlib.Path, device: str, gpu: str) -> pathlib.Path:
    """The shipped default profile as `modelpool calibrate` would have written it on `device` for GPU type `gpu`."""
    import json
    from importlib import resources

    data = json.loads(resources.files("sims.profiles").joinpath("default.json").read_text())
    data["name"] = f"{gpu}-mine"
    data["calibration"] = {"command": f"modelpool calibrate --device {device}", "device": device, "gpu": gpu,
                           "measured_at": "2026-12-01T00:00:00Z"}
    path = tmp_path / f"{gpu}-mine.json"
    path.write_text(json.dumps(data))
    return path


def test_a_cpu_profile_on_a_gpu_fleet_is_refused_naming_both(tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cpu = calibrated_profile(tmp_path, "cpu", "cpu-box")
    for command in (["simulate", "--fleet", str(tiny_fleet), "--duration", "10"],
                    ["capacity", "--fleet", str(tiny_fleet), "--duration", "10", "--workers", "0",
                     "--out", str(tmp_path / "r")],
                    ["estimate", "--model", "small-a", "--fleet", str(tiny_fleet)]):
        code, output = invoke(*command, "--profile", str(cpu))
        assert code == 1, command
        assert (f"--profile {cpu} was measured on cpu (calibrated as GPU type cpu-box), but the fleet runs on H20"
                in " ".join(output.split())), command


def test_a_profile_from_another_gpu_type_is_warned_about(tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    h200 = calibrated_profile(tmp_path, "NVIDIA H200", "h200")
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "10", "--profile", str(h200))
    assert code == 0, output
    assert (f"warning: --profile {h200} was measured on NVIDIA H200 (calibrated as GPU type h200), not on H20"
            in output)
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "10",
                          "--profile", str(calibrated_profile(tmp_path, "NVIDIA H20", "h20")))
    assert code == 0 and "warning" not in output  # measured where it runs: nothing to say


# ---- 7: estimate reads models.yaml like the other commands; a model that does not fit gets no latency ----------


def test_estimate_defaults_to_models_yaml_and_refuses_latencies_for_a_model_that_does_not_fit(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.yaml").write_text(TINY_FLEET)
    code, output = invoke("estimate", "--model", "small-a")  # the GPU comes from ./models.yaml (H20)
    assert code == 0, output
    assert "small-a (qwen2.5-1.5b) on 1 x H20" in output and "TPOT" in output
    code, output = invoke("estimate", "--model", "qwen2.5-72b")  # a catalogue arch on the fleet's GPU
    assert code == 1
    assert "qwen2.5-72b does not fit 1 x H20: 145.4 GB of weights against 86.4 GB usable" in output
    assert "no latency is predicted (try --tp 2)" in output and "TPOT" not in output
    code, output = invoke("estimate", "--model", "qwen2.5-72b", "--json")
    report = json.loads(output[output.index("{"):])
    assert report["weights_fit"] is False and report["tpot_s"] is None and report["smallest_tp_that_fits"] == 2
    code, output = invoke("estimate", "--model", "qwen2.5-72b", "--tp", "2")
    assert code == 0 and "TPOT" in output
    (tmp_path / "models.yaml").unlink()
    code, output = invoke("estimate", "--model", "qwen2.5-7b")
    assert code == 1 and "no --gpu and no fleet file to take it from (models.yaml not found here)" in output
    code, output = invoke("estimate", "--model", "qwen2.5-7b", "--gpu", "h100")
    assert code == 0 and "qwen2.5-7b on 1 x H100" in output


# ---- 8: traces fetch with no network -----------------------------------------------------------------------------


def test_an_offline_fetch_names_the_ways_around_it_and_leaves_no_folder(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MODELPOOL_TRACES_CACHE", str(cache))
    monkeypatch.delenv("MODELPOOL_TRACES_MIRROR", raising=False)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):  # offline: nothing answers
        monkeypatch.setenv(name, "http://127.0.0.1:1")
    code, output = invoke("traces", "fetch", "mooncake")
    text = " ".join(output.split())
    assert code == 1
    assert "mooncake/conversation_trace.jsonl: cannot reach raw.githubusercontent.com" in text
    assert "`--mirror URL` or $MODELPOOL_TRACES_MIRROR" in text and "point $MODELPOOL_TRACES at it" in text
    assert "run the fetch again" not in text  # nothing to resume
    assert not cache.exists()
    code, output = invoke("traces", "fetch", "mooncake", "--mirror", "http://127.0.0.1:1")
    assert code == 1 and "the mirror http://127.0.0.1:1 (--mirror or $MODELPOOL_TRACES_MIRROR) is unreachable" \
        in " ".join(output.split())
    assert not cache.exists()


def test_a_fetch_from_a_host_that_does_not_resolve_says_so_and_leaves_no_folder(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # RFC 6761's .invalid never resolves: the lookup fails as on a machine with no DNS ("Name or service not known")
    monkeypatch.setenv("MODELPOOL_TRACES_CACHE", str(tmp_path / "cache"))
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    code, output = invoke("traces", "fetch", "mooncake", "--mirror", "http://traces.invalid/mirror",
                          "--dir", str(tmp_path / "elsewhere" / "traces"))
    text = " ".join(output.split())
    assert code == 1 and "cannot reach traces.invalid" in text
    assert "the mirror http://traces.invalid/mirror (--mirror or $MODELPOOL_TRACES_MIRROR) is unreachable" in text
    assert "run the fetch again" not in text and not (tmp_path / "elsewhere").exists()


# ---- 6: simulate says when the pool falls short, and what to run; its title keeps the workload whole ------------


def test_simulate_on_an_overloaded_pool_says_how_it_was_cut_and_to_run_capacity(tiny_fleet: pathlib.Path) -> None:
    spec = "poisson;rate=8;duration=30"
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--gpus", "2", "--trace", spec)
    assert code == 0, output
    text = " ".join(output.split())
    assert ("2 H20s under token-level, cut by traffic share and pool.prefill_fraction (TP1: 1P+1D), fall short of "
            "this traffic. `modelpool capacity` finds the fewest GPUs each policy needs to meet a target and how to "
            "cut them per TP class; then `modelpool simulate --layout capacity-report/report.json`") in text
    assert spec in output  # the workload row gives the spec whole
    assert "instances per TP class TP1: 1P+1D" in flat(output)
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "60")
    assert code == 0 and "fall short" not in output
    assert "each model's traffic hint (Poisson, 0.63 req/s in all), ShareGPT lengths, 60 s" in flat(output)


def test_simulate_runs_a_layout_given_by_hand_and_refuses_one_that_does_not_fit_the_fleet(
        tiny_fleet: pathlib.Path) -> None:
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "20", "--layout", "TP1:1P+2D")
    assert code == 0, output
    assert "token-level on 3 GPUs" in output and "instances per TP class TP1: 1P+2D" in flat(output)
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "20", "--policy", "request-level",
                          "--layout", "TP1:3M")
    assert code == 0 and "request-level on 3 GPUs" in output and "TP1: 3M" in output
    for layout, why in (("TP1:2P+1D,TP2:1M", "gives TP classes [1, 2], the fleet's models need exactly TP [1]"),
                        ("TP1:2P", "TP1: prefill instances need decode (or mixed) ones"),
                        ("1P+1D", "'1P+1D' is not TPn:ROLES")):
        code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "5", "--layout", layout)
        assert code == 1 and f"error: --layout '{layout}'" in output and why in flat(output), output
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "5", "--policy", "request-level",
                          "--layout", "TP1:1P+1D")
    assert code == 1 and "prefill/decode instances are token-level's; request-level takes mixed ones" in output
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--duration", "5", "--layout", "TP1:1P+1D",
                          "--gpus", "3")
    assert code == 1 and "--gpus 3 but --layout TP1:1P+1D has 2 GPUs" in output


@pytest.mark.slow
def test_simulate_with_no_arguments_explains_the_shipped_pools_shortfall_and_capacitys_cut_meets_it(
        tmp_path: pathlib.Path) -> None:
    import json

    code, output = invoke("simulate")  # models.yaml at the repository root, its traffic hints, 600 s
    assert code == 0, output
    text = flat(output)
    assert "token-level on 16 GPUs" in output
    assert "each model's traffic hint (Poisson, " in text and "ShareGPT lengths, 600 s" in text
    assert ("16 H20s under token-level, cut by traffic share and pool.prefill_fraction (TP1: 2P+2D, TP2: 1P+1D, "
            "TP4: 1P+1D), fall short of this traffic. `modelpool capacity`") in text
    # the same 16 GPUs cut as `modelpool capacity` answers for seed 0 (BENCHMARKS.md, stability) meet 99%
    code, output = invoke("simulate", "--layout", "TP1:4P+4D,TP2:2M,TP4:1M", "--out", str(tmp_path))
    assert code == 0, output
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_gpus"] == 16 and metrics["layout"] == "TP1: 4P+4D, TP2: 2M, TP4: 1M"
    assert metrics["slo_attainment"] >= 0.99 and "fall short" not in output


# ---- 2 and 4: the report says how sure it is and shows every model's SLO result, laid out for a laptop's browser ---

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--window-size=1366,768"]


def probe_in_chromium(page: str, probe: str, folder: pathlib.Path) -> dict:
    """Lay `page` out in headless Chromium at a laptop's size with the `probe` script appended (it writes JSON into
    a <pre id="probe">): nothing may run off the page; what the probe measured."""
    import html
    import json
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    probed = folder / "probed.html"
    probed.write_text(page.replace("</body>", probe + "</body>"))
    run = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={folder / 'profile'}", "--dump-dom",
                          probed.as_uri()], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    probed = json.loads(html.unescape(run.stdout.split("<pre id=\"probe\">", 1)[1].split("</pre>", 1)[0]))
    assert probed["innerWidth"] == 1366
    assert probed["scrollWidth"] <= probed["innerWidth"], probed  # the page never scrolls sideways
    assert probed["wideTables"] == [], probed  # nor does any table overflow its box
    return probed


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (scripts/setup.sh installs "
                                                             "it under CI; apt-get install chromium)")


# appended to a copy of the report (the report itself runs no script): what a reader's browser lays out
PROBE = """<script>
const doc = document.documentElement, wide = [];
for (const box of document.querySelectorAll('.scroll')) {
  if (box.scrollWidth > box.clientWidth + 1) wide.push(box.querySelector('th') ? box.querySelector('th').textContent : '?');
}
const perModel = document.querySelector('#per-model + ul + .scroll');
const probe = document.createElement('pre');
probe.id = 'probe';
probe.textContent = JSON.stringify({scrollWidth: doc.scrollWidth, innerWidth: window.innerWidth, wideTables: wide,
  stability: (document.getElementById('stability') || {}).textContent || null,
  perModelRows: perModel.querySelectorAll('tbody tr').length,
  misses: Array.from(perModel.querySelectorAll('td.miss')).map(td => td.parentElement.firstElementChild.textContent),
  missColour: document.querySelector('td.miss') ? getComputedStyle(document.querySelector('td.miss')).backgroundColor : null});
document.body.appendChild(probe);
</script>"""


@pytest.fixture(scope="module")
def tight_report(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """`capacity --seeds 2` on the tiny fleet with one model's TPOT SLO out of reach: misses to show."""
    folder = tmp_path_factory.mktemp("tight")
    fleet = folder / "tight.yaml"
    fleet.write_text(TINY_FLEET.replace("rate_rps: 0.1}}", "rate_rps: 0.1}, slo: {ttft_s: 10, tpot_s: 0.002}}"))
    code, output = invoke("capacity", "--fleet", str(fleet), "--duration", "60", "--workers", "0", "--what-if-tpot",
                          "0", "--seeds", "2", "--out", str(folder / "report"))
    assert code == 0, output
    assert "Stability: 3 of 3 models get fewer than 100 requests in 60 s" in flat(output)
    assert "GPUs across seeds 0, 1: dedicated" in flat(output)
    return folder / "report"


def test_the_report_says_which_models_have_too_few_requests_and_the_spread_over_seeds(tight_report: pathlib.Path) -> None:
    import json

    report = json.loads((tight_report / "report.json").read_text())
    st = report["stability"]
    assert st["min_requests_to_judge"] == 100 and st["seeds"] == [0, 1]
    assert {r["model"] for r in st["few_requests"]} == {"small-a", "small-b", "small-c"}
    assert set(st["gpus_by_seed"]) == set(report["policies"]) and all(len(g) == 2 for g in st["gpus_by_seed"].values())
    assert all(lo <= hi for lo, hi in st["spread"].values())
    assert st["gpus_by_seed"]["dedicated"][0] == report["policies"]["dedicated"]["gpus"]
    assert report["model_misses"]["token-level"] == ["small-c"]
    markdown = (tight_report / "report.md").read_text()
    assert st["sentence"] in markdown and "| policy | seed 0 | seed 1 | spread |" in markdown
    assert "| small-c | 1 |" in markdown and "**MISS** 0.00%" in markdown
    code, output = invoke("capacity", "--fleet", str(tight_report.parent / "tight.yaml"), "--trace",
                          str(_generic_trace(tight_report.parent)), "--seeds", "2", "--workers", "0")
    assert code == 1 and "is the same under every seed (a trace file)" in flat(output)


def test_simulate_runs_a_capacity_reports_answer_as_one_pool(tight_report: pathlib.Path) -> None:
    import json

    report = json.loads((tight_report / "report.json").read_text())
    fleet = str(tight_report.parent / "tight.yaml")
    for policy in ("token-level", "dedicated"):
        answer = report["policies"][policy]
        code, output = invoke("simulate", "--fleet", fleet, "--duration", "20", "--policy", policy,
                              "--layout", str(tight_report / "report.json"))
        assert code == 0, output
        assert f"{policy} on {answer['gpus']} GPUs" in output
    code, output = invoke("simulate", "--fleet", fleet, "--duration", "5", "--policy", "spatial",
                          "--layout", str(tight_report / "missing.json"))
    assert code == 1 and "cannot read a capacity report" in output


def test_a_wide_spread_over_seeds_and_a_seed_that_misses_are_called_out() -> None:
    from sims.report import stability

    report = {"slo_target": 0.99, "workload": {"duration_s": 600.0},
              "per_model": [{"model": "busy", "requests": 500}, {"model": "rare", "requests": 12}],
              "policies": {"token-level": {"gpus": 16, "met": True}, "dedicated": {"gpus": 63, "met": True}}}
    repeats = {1: {"token-level": (19, True), "dedicated": (60, True)},
               2: {"token-level": (18, False), "dedicated": (63, True)}}
    st = stability(report, 0, repeats)
    assert st["spread"] == {"token-level": [16, 19], "dedicated": [60, 63]} and st["wide"] == ["token-level"]
    assert st["sentence"] == (
        "Stability: 1 of 2 models get fewer than 100 requests in 600 s (rare 12): at a 99.0% target one miss fails "
        "such a model, so its share of the answer rests on a few arrivals; GPUs across seeds 0, 1, 2: token-level "
        "16-19, dedicated 60-63; the spread is wide for token-level 16-19 (seed 0 gave 16): size for the high end, "
        "or steady the answer with a longer --duration; token-level misses the target under seed 2.")
    steady = stability(report, 0, {1: {"token-level": (17, True), "dedicated": (63, True)}})
    assert steady["wide"] == [] and "wide" not in steady["sentence"] and "misses" not in steady["sentence"]


def _generic_trace(folder: pathlib.Path) -> pathlib.Path:
    path = folder / "rows.csv"
    path.write_text(HEADER + "".join(f"{k},small-a,50,5\n" for k in range(5)))
    return path


@pytest.mark.slow
@needs_chromium
def test_the_report_in_a_laptop_browser_shows_every_models_slo_result_and_nothing_runs_off(
        tight_report: pathlib.Path, tmp_path: pathlib.Path) -> None:
    import json
    import subprocess

    probe = probe_in_chromium((tight_report / "report.html").read_text(), PROBE, tmp_path / "profile-a")
    assert probe["stability"].startswith("Stability: 3 of 3 models get fewer than 100 requests")
    assert probe["perModelRows"] == 3
    assert set(probe["misses"]) == {"small-c"} and len(probe["misses"]) == 4  # its cell under each policy
    assert probe["missColour"] == "rgb(253, 226, 226)"
    shot = tmp_path / "report.png"  # what a reader sees first: a real screenshot at the laptop's size
    run = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'profile-b'}", f"--screenshot={shot}",
                          (tight_report / "report.html").as_uri()], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1366, 768)
