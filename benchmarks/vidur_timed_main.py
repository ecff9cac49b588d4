"""Vidur's `vidur.main` with its event loop timed (wall and CPU) and its batches (model iterations) counted.

Run with Vidur importable (PYTHONPATH=<vidur checkout>) and Vidur's own command-line options; the last line
printed is `VIDUR_TIMING {json}`, which benchmarks/vidur_compare.py --vidur-command reads.
"""
import json
import time

t0 = time.perf_counter()
from vidur.config import SimulationConfig  # noqa: E402
from vidur.events.batch_end_event import BatchEndEvent  # noqa: E402
from vidur.simulator import Simulator  # noqa: E402
from vidur.utils.random import set_seeds  # noqa: E402

count = {"batches": 0}
_handle = BatchEndEvent.handle_event


def handle_event(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    count["batches"] += 1
    return _handle(self, *args, **kwargs)


BatchEndEvent.handle_event = handle_event
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
simulator = Simulator(config)
t1, c1 = time.perf_counter(), time.process_time()
simulator.run()
t2, c2 = time.perf_counter(), time.process_time()
print("VIDUR_TIMING " + json.dumps({"setup_s": round(t1 - t0, 3), "event_loop_s": round(t2 - t1, 3),
                                    "event_loop_cpu_s": round(c2 - c1, 3), "batches": count["batches"]}), flush=True)
