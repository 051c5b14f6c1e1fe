"""Host-bucket attribution from prof_n{N}.pstats (full-run cProfile, engine thread).
Per Python function: exclusive time = own tottime + builtins it calls (by pstats caller split),
excluding everything under RoundTimer's `timed` wrapper (prefill/decode/vocoder buckets).
Prints per-stream slope (us per stream per round, profiled) and N=64 absolute."""
import pstats, sys, numpy as np
from pathlib import Path
d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/host_profile"
ns = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,32,64").split(",")]
ROUNDS = 200
def name(k):
    fn, line, f = k
    fn = fn.replace(str(Path(__file__).resolve().parents[3]) + "/", "")
    fn = fn.split("site-packages/")[-1].split("lib/python3.11/")[-1]
    return f"{fn}:{line}({f})"
tables = {}
for n in ns:
    st = pstats.Stats(f"{d}/prof_n{n}.pstats").stats
    callees = {}
    for k, v in st.items():
        for c in v[4]:
            callees.setdefault(c, set()).add(k)
    # subtree under timed (and the idle wait), where all callers are inside
    roots = {k for k in st if k[2] in ("timed",) and "round_timing" in k[0]}
    inside = set(roots)
    changed = True
    while changed:
        changed = False
        for k, v in st.items():
            if k in inside or not v[4]:
                continue
            if all(c in inside for c in v[4]):
                inside.add(k); changed = True
    excl = {}
    for k, v in st.items():
        if k in inside:
            continue
        builtin = k[0] == "~"
        if not builtin:
            excl[k] = excl.get(k, 0.0) + v[2]
        else:
            for caller, cv in v[4].items():
                if caller in inside:
                    continue
                tgt = caller
                excl[(tgt[0], tgt[1], tgt[2])] = excl.get(tgt, 0.0) + cv[2]
    serve = [k for k in st if k[2] == "_serve" and "engine/service.py" in k[0]][0]
    waits = sum(v[3] for k, v in st.items() if k[2] in ("wait",) and "threading" in k[0])
    timed = sum(st[k][3] for k in roots)
    host_total = st[serve][3] - timed - waits
    tables[n] = (excl, host_total)
    print(f"n={n}: host (profiled) {1e6*host_total/ROUNDS:.0f} us/round; timed {1e6*timed/ROUNDS:.0f}")
xs = np.array(ns, float)
ht = [tables[n][1] * 1e6 / ROUNDS for n in ns]
s, i = np.polyfit(xs, ht, 1)
print(f"host profiled fit: {i:.1f} us + {s:.2f} us/stream")
keys = set().union(*(t[0].keys() for t in tables.values()))
rows = []
for k in keys:
    y = [tables[n][0].get(k, 0.0) * 1e6 / ROUNDS for n in ns]
    sl, ic = np.polyfit(xs, y, 1)
    rows.append((sl, ic, y[-1], name(k)))
rows.sort(reverse=True)
tot = sum(r[0] for r in rows)
print(f"sum of slopes {tot:.2f}")
print(" us/st/round  fixed_us  us@N=64  function (own + builtins called, host bucket only)")
for r in rows[:40]:
    print(f"{r[0]:9.3f} {r[1]:9.1f} {r[2]:9.1f}  {r[3]}")
