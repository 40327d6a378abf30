"""The GPU check's summary (cuda/check/run.sh, last): every section's
outcome, then the figures the sections wrote under OUT. A section that
did not run (skipped, timed out, failed) is named with why and its
figures are left out; the summary itself never fails on a missing file.

Usage: python3 cuda/check/summary.py OUT
Exits 1 when a section failed or timed out, 0 otherwise (skipped ones included).
"""
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1])


def text(name):
    path = out / name
    return path.read_text(errors="replace") if path.exists() else ""


def json_line(name):
    """The first JSON object of file `name`, or None."""
    for line in text(name).splitlines():
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def gib(value):
    return f"{value / 2**30:.2f} GiB" if isinstance(value, (int, float)) else "unknown"


def guarded(what, figures):
    """Prints `figures()`; a file without a figure it needs is named, not fatal."""
    try:
        figures()
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        print(f"{what}: figures incomplete ({type(err).__name__}: {err})")


# sections.tsv: a line per section, NAME, VERDICT and (run.sh's newer
# lines) the time it took of its limit, tab-separated.
rows = [(line.split("\t") + [""])[:3] for line in text("sections.tsv").splitlines() if "\t" in line]
sections = [(name, verdict) for name, verdict, _ in rows]
outcome = dict(sections)
print("gpu:", text("gpu.txt").strip() or "unknown")
width = max((len(name) for name, _ in sections), default=0)
vwidth = max((len(verdict) for _, verdict in sections), default=0)
for name, verdict, took in rows:
    print(f"  {name:{width}s}  {verdict:{vwidth}s}  {took}".rstrip())


def ran(name):
    return outcome.get(name) == "ok"


card = text("card.txt").strip().splitlines()
if ran("card") and card:
    print(card[-1])
for name in ["conformance", "conformance-whole"]:
    if ran(name) and "cuda conformance: ok" not in text(f"{name}.txt"):
        print(f"{name}: exited 0 but did not print 'cuda conformance: ok'")
for line in text("tags.txt").splitlines():
    if ran("tags") and line.startswith(("graph across pause", "bandwidth", "latency")):
        print("tags: " + line)
for line in text("vmm.txt").splitlines():
    if ran("vmm") and line.startswith(("calls at", "warm-up")):
        print("driver calls: " + line)



for line in text("warmup.json").splitlines():
    if line.startswith("{"):
        w = json.loads(line)
        print(f"trace warm-up, {w.get('allocator')} {w.get('conf', '')}: {w.get('warm_up_s')} s then {w.get('steady_s')} s, "
              f"peak reserved {gib(w.get('peak_reserved_bytes'))} for {gib(w.get('peak_live_bytes'))} live, "
              f"allocations {w.get('device_allocs')}, frees {w.get('device_frees')}"
              + (f", driver calls {w['driver_calls']}" if w.get("driver_calls") is not None else ""))
for name in ["rust-runtime", "rust-runtime-whole"]:
    if ran(name) and "equal to the host's" not in text(f"{name}.txt"):
        print(f"{name}: exited 0 but its results were not compared equal to the host's")


# torch_e2e.py's allocators, in run.sh's order: section e2e-NAME writes e2e-NAME.json.
E2E = [("native", "PyTorch's allocator"), ("native-expandable", "PyTorch's expandable_segments:True"),
       ("tidepool", "tidepool's default (expandable)"), ("tidepool-whole", "tidepool's whole segments")]


def number(value, spec=".2f"):
    """`value` formatted, "-" when unknown."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    try:
        return format(value, spec)
    except ValueError:  # a float where an int was expected
        return format(value, ".1f")


def step_table():
    """A training step's time with each allocator, its warm-up's extra time
    and its driver calls: a row per allocator, whatever its section did."""
    runs = {name: json_line(f"e2e-{name}.json") for name, _ in E2E}
    if not any(f"e2e-{name}" in outcome for name, _ in E2E):
        return
    steps = next((r.get("steps") for r in runs.values() if r and r.get("steps")), None)
    print(f"training step (torch_e2e.py, {steps or '?'} steps, times in ms): steady = median of steps 3..N, /PyTorch its "
          "ratio to PyTorch's allocator's (tidepool's target: 1.02 at most);\n"
          "  warm-up = steps 1 and 2, extra = what they took beyond steady steps of their sequence lengths, "
          "-PyTorch its difference from PyTorch's allocator's;\n"
          "  calls>2 = driver calls after step 2, calls>warm = after every sequence length was seen once (0 when warm)")
    print(f"  {'allocator':35s} {'steady ms':>9s} {'/PyTorch':>8s} {'warm-up ms':>10s} {'extra ms':>9s} {'-PyTorch':>9s} "
          f"{'calls>2':>8s} {'calls>warm':>10s}  counted as")
    base = runs.get("native") if outcome.get("e2e-native") == "ok" else None
    for name, label in E2E:
        r, verdict = runs[name], outcome.get(f"e2e-{name}", "not run")
        if r is None or "steady_step_ms" not in r:
            # No figures: the section did not run, failed before its line, or wrote an older line.
            print(f"  {label:35s} {verdict if r is None else verdict + ', no step figures'}")
            continue
        steady, extra = r.get("steady_step_ms"), r.get("warm_up_extra_ms")
        ratio = steady / base["steady_step_ms"] if base and base.get("steady_step_ms") and isinstance(steady, (int, float)) else None
        over = extra - base["warm_up_extra_ms"] if base and isinstance(base.get("warm_up_extra_ms"), (int, float)) and isinstance(extra, (int, float)) else None
        notes = [n for n in [r.get("driver_calls_counted") or "", "" if verdict == "ok" else verdict,
                             "on the host: not measured" if r.get("device") == "cpu" else ""] if n]
        print(f"  {label:35s} {number(steady):>9s} {number(ratio, '.3f'):>8s} {number(r.get('warm_up_ms'), '.1f'):>10s} "
              f"{number(extra, '.1f'):>9s} {number(over, '+.1f'):>9s} {number(r.get('driver_calls_after_step_2'), 'd'):>8s} "
              f"{number(r.get('driver_calls_after_warm_up'), 'd'):>10s}  {'; '.join(notes)}")


def end_to_end():
    runs = {name: json_line(f"e2e-{name}.json") for name, _ in E2E}
    # The GPU's runs that finished (the rehearsal's runs on the host check no GPU behaviour).
    runs = {name: r for name, r in runs.items() if r is not None and ran(f"e2e-{name}") and r.get("device", "cuda") == "cuda"}
    if not runs:
        return
    if "native" in runs:
        n = runs["native"]
        print("losses identical to PyTorch's allocator's: "
              + ", ".join(f"{name} {r.get('losses') == n.get('losses')}" for name, r in runs.items() if name != "native"))
    for name, r in runs.items():
        print(f"peak reserved {name:18s} training {gib(r.get('train_peak_reserved_bytes'))}, "
              f"whole run (out of memory and batch search included) {gib(r.get('peak_reserved_bytes'))}")
    for name in ("tidepool", "tidepool-whole"):
        if name in runs:
            t = runs[name]
            print(f"{name}: stats sane {t.get('stats_sane')}, snapshot in memory_viz {t.get('snapshot_loads_in_memory_viz')}, "
                  f"pages mapped/unmapped after warm-up {t.get('pages_mapped_after_warm_up')}/{t.get('pages_unmapped_after_warm_up')} "
                  f"(target 0/0 for the default)")
    for key in ["oom_raises", "oom_observer_calls", "continues_after_oom", "batch_search_found", "peak_api_ok",
                "memory_stats_keys", "frames_name_this_file", "api_error"]:
        print(f"{key:22s} " + ", ".join(f"{name} {r.get(key)}" for name, r in runs.items()))
    print("CUDA graph replay intact: " + ", ".join(f"{name} {r.get('graph_ok')}" for name, r in runs.items()))


def models():
    for name in ["native", "native-expandable"]:
        m = json_line(f"model-{name}.json")
        if m is not None and ran(f"model-{name}"):
            recorded = m["pytorch_recorded_peak_reserved_bytes"]
            print(f"model of {name}: peak reserved {m['peak_reserved_bytes'] / 2**30:.3f} GiB, PyTorch recorded "
                  f"{recorded / 2**30:.3f} GiB ({100 * (m['peak_reserved_bytes'] / recorded - 1):+.2f} %)")


def other_runtimes():
    """runtimes_check.py's verdict per runtime (CuPy, Numba) with tidepool's
    figures, and memory_saver_check.py's per case."""
    if "runtimes" in outcome and text("runtimes.json"):
        for r in json.loads(text("runtimes.json")).get("runtimes", []):
            f = r.get("figures") or {}
            figures = (f"; peak allocated {r.get('peak_allocated_bytes', f.get('allocated_bytes.all.peak', 0)) / 2**20:.1f} MiB, "
                       f"{f.get('tidepool.num_allocs')} allocations, {f.get('tidepool.num_frees')} frees, "
                       f"{f.get('tidepool.num_driver_calls')} driver calls, {f.get('num_ooms')} OOMs" if f else "")
            kernels = f", kernels {r['kernels_s']} s" if "kernels_s" in r else ""
            print(f"runtime {r.get('runtime')} {r.get('versions', '')}: {r.get('status')}{figures}{kernels}")
    m = json_line("memory_saver.json")
    if "memory-saver" in outcome and m is not None:
        for name, case in m.get("cases", {}).items():
            verdict = "skipped: " + case["skipped"] if case.get("skipped") else "ok" if case.get("ok") else f"FAILED {case.get('error')}"
            freed = f", device memory freed by the pause {gib(case['device_freed'])}" if case.get("device_freed") is not None else ""
            print(f"memory saver {name}: {verdict}{freed}, {case.get('seconds', '?')} s")


guarded("training step", step_table)
guarded("PyTorch end to end", end_to_end)
guarded("models of PyTorch's allocator", models)
guarded("other runtimes", other_runtimes)
bad = [name for name, verdict in sections if not (verdict == "ok" or verdict.startswith("skipped"))]
print(f"sections: {len(sections)}, ok {sum(v == 'ok' for _, v in sections)}, "
      f"skipped {sum(v.startswith('skipped') for _, v in sections)}, not ok {len(bad)}" + (f": {', '.join(bad)}" if bad else ""))
sys.exit(1 if bad else 0)
