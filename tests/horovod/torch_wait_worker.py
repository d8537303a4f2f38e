"""Run under `horovodrun -np 2`: rank 0 waits in `hvd.synchronize` for an allreduce that rank 1
joins only after a pause, and prints how much CPU its waiting thread used meanwhile.

Horovod's torch `synchronize` spun on `sched_yield` while waiting (patches/0008 makes it block);
a spinning waiter uses about as much CPU as the wait lasts.
The pause is also an idle spell for rank 1, with nothing queued (patches/0010: no negotiation
every cycle meanwhile; the test counts rank 0's cycles in the timeline).
"""

import json
import time

import horovod.torch as hvd
import torch

PAUSE_S = 2.0

hvd.init()
hvd.barrier()
if hvd.rank() == 1:
    time.sleep(PAUSE_S)
handle = hvd.allreduce_async(torch.full((4,), float(hvd.rank() + 1)), op=hvd.Sum, name="late")
cpu, wall = time.thread_time(), time.perf_counter()
result = hvd.synchronize(handle)
cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
# Many short waits still complete (no lost wake-up between MarkDone and the wait).
quick = [hvd.synchronize(hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name=f"q{i}")) for i in range(200)]
print(json.dumps({"rank": hvd.rank(), "result": result.tolist(), "wait_cpu_s": cpu, "wait_s": wall,
                  "quick_ok": all(float(q) == hvd.size() for q in quick)}), flush=True)
