"""bench/decode_anatomy.py on a build patched by patch.py (bench/timeline/README.md), with the
timeline's columns for fa2cpu: fa_region (the parallel region), fa_pre_region (forward() before
it), fa_call_pre_forward / fa_call_total (DecodeStep.__call__ up to forward() / in all), fa_item
(median item), fa_last_start (when the last item starts), microseconds, medians of the second
half of the steps.

    PYTHONPATH=/tmp/tr python bench/timeline/decode_model.py 16
"""
import contextlib, os, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode_anatomy  # noqa: E402  (sets the threads from argv, imports torch)


@contextlib.contextmanager
def traced(rnd, dtype, res):
    path = f"/tmp/xtm_{rnd}_{dtype}.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(fd, 2)
    os.environ["FA2CPU_XTRACE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("FA2CPU_XTRACE")
        os.dup2(saved, 2)
        os.close(fd)
    mhz = float([l for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")][0].split(":")[1])
    regs, cur, steps_x = [], None, []
    for line in open(path):
        if line.startswith("XCALL"):
            cur = [int(line.split()[1]) / mhz, [], int(line.split()[5]) / mhz]
            regs.append(cur)
        elif line.startswith("XSTEP"):
            steps_x.append((int(line.split()[1]) / mhz, int(line.split()[2]) / mhz))
        elif line.startswith("XI") and cur is not None:
            _, tid, item, a, b = line.split()
            cur[1].append((int(a) / mhz, int(b) / mhz))
    regs, steps_x = regs[len(regs) // 2:], steps_x[len(steps_x) // 2:]
    res[(rnd, "fa_region")] = statistics.median(r[0] for r in regs)
    res[(rnd, "fa_call_pre_forward")] = statistics.median(a for a, b in steps_x)
    res[(rnd, "fa_call_total")] = statistics.median(b for a, b in steps_x)
    res[(rnd, "fa_pre_region")] = statistics.median(r[2] for r in regs)
    res[(rnd, "fa_item")] = statistics.median(b - a for r in regs for a, b in r[1])
    res[(rnd, "fa_last_start")] = statistics.median(max(a for a, b in r[1]) for r in regs)


if __name__ == "__main__":
    decode_anatomy.main(traced)
