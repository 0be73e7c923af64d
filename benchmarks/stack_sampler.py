"""Where each thread of a Python program spends its wall time: samples every thread's stack every few milliseconds
(sys._current_frames, no ptrace needed) and writes, per thread, the most frequent innermost frames of our own code
and of everything, with their share of the samples.

    python benchmarks/stack_sampler.py OUT.json [--interval-ms 5] -- \
        -m diffrl train diffrl/configs/shapes_flow_grpo.yaml ...
    python benchmarks/stack_sampler.py OUT.json -- benchmarks/train_e2e.py --config ...

Wall time, not CPU or GIL time: a thread waiting on a future or the GPU is counted where it waits.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _frames(frame, depth: int = 40) -> list[str]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        where = code.co_filename
        where = os.path.relpath(where, REPO) if where.startswith(REPO) else os.path.basename(where)
        out.append(f"{where}:{code.co_name}")
        frame = frame.f_back
    return out


def main() -> None:
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    split = sys.argv.index("--")
    out_path, options, target = sys.argv[1], sys.argv[2:split], sys.argv[split + 1 :]
    interval = float(options[options.index("--interval-ms") + 1]) / 1e3 if "--interval-ms" in options else 0.005
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident)).split("_")[0]
                stack = _frames(frame)
                totals[name] += 1
                counts[name][" < ".join(stack[:3])] += 1
                mine = [
                    f
                    for f in stack
                    if not f.startswith((".venv", "threading", "thread.py", "_base.py"))
                    and ".py:" in f
                    and "/" in f.split(":")[0]
                ]
                ours[name][" < ".join(mine[:2]) or "(outside diffrl)"] += 1
            time.sleep(interval)

    thread = threading.Thread(target=sample, name="stack-sampler", daemon=True)
    thread.start()
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = target
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit:
        pass
    finally:
        stop.set()
        thread.join()
        report = {
            name: {
                "samples": totals[name],
                "top_innermost": [[k, v / totals[name]] for k, v in counts[name].most_common(25)],
                "top_in_diffrl": [[k, v / totals[name]] for k, v in ours[name].most_common(25)],
            }
            for name in sorted(totals, key=lambda n: -totals[n])
        }
        with open(out_path, "w") as f:
            json.dump({"interval_s": interval, "command": target, "threads": report}, f, indent=1)


if __name__ == "__main__":
    main()
