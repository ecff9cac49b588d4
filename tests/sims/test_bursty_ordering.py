"""Issue 35 item 2: on bursty long-prompt traffic (a production conversation trace's own timings and prompt/output
lengths, replayed over the shipped fleet) token-level needs no more GPUs than request-level. Needs the Azure
conversation trace (../shared/traces or $MODELPOOL_TRACES; `modelpool traces fetch azure-conv`); skips without."""

from __future__ import annotations

import pytest

from sims.capacity import Goal, InlineEvaluator
from sims.capacity_eval import Context, evaluate, run_pool
from sims.capacity_study import StudyConfig, study
from sims.scenarios import SCENARIOS, shipped_fleet
from sims.workload import TraceError


@pytest.mark.slow
def test_token_level_needs_no_more_gpus_than_request_level_on_bursty_long_prompts() -> None:
    try:
        workload = SCENARIOS["shipped-azure-conv"].workload(4.0, 120.0, seed=0)
    except TraceError as exc:
        pytest.skip(str(exc))
    assert workload.input_tokens.mean() > 800  # long prompts: the trace's own lengths, not ShareGPT's
    ctx = Context(shipped_fleet(), workload, None, stop_below=0.99)
    result = study(ctx, StudyConfig(("request-level", "token-level"), ("h20",), Goal(0.99), None),
                   InlineEvaluator(lambda point: evaluate(ctx, point)),
                   lambda jobs: [run_pool(ctx, *job) for job in jobs])
    request_level, token_level = result.answer("request-level"), result.answer("token-level")
    assert request_level is not None and token_level is not None and token_level.met
    assert token_level.gpus <= request_level.gpus, (token_level.gpus, request_level.gpus)
