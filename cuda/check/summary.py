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


sections = [line.split("\t", 1) for line in text("sections.tsv").splitlines() if "\t" in line]
outcome = dict(sections)
print("gpu:", text("gpu.txt").strip() or "unknown")
width = max((len(name) for name, _ in sections), default=0)
for name, verdict in sections:
    print(f"  {name:{width}s}  {verdict}")


def ran(name):
    return outcome.get(name) == "ok"


card = text("card.txt").strip().splitlines()
if ran("card") and card:
    print(card[-1])
for name in ["conformance", "conformance-expandable"]:
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
              f"allocations {w.get('device_allocs')}")
for name in ["rust-runtime", "rust-runtime-expandable"]:
    if ran(name) and "equal to the host's" not in text(f"{name}.txt"):
        print(f"{name}: exited 0 but its results were not compared equal to the host's")


def end_to_end():
    runs = {name: json_line(f"e2e-{name}.json") for name in ["native", "native-expandable", "tidepool", "tidepool-expandable"]}
    runs = {name: r for name, r in runs.items() if r is not None and ran(f"e2e-{name}")}
    if "native" in runs and "tidepool" in runs:
        n, t = runs["native"], runs["tidepool"]
        print(f"losses identical: {n['losses'] == t['losses']}")
        print(f"step time tidepool/native: {t['median_step_s'] / n['median_step_s']:.3f} (target <= 1.02)")
        for name, r in runs.items():
            print(f"peak reserved {name:18s} {r['peak_reserved_bytes'] / 2**30:7.3f} GiB")
        print(f"tidepool stats sane: {t.get('stats_sane')}, snapshot in memory_viz: {t.get('snapshot_loads_in_memory_viz')}")
        for key in ["oom_raises", "oom_observer_calls", "continues_after_oom", "batch_search_found", "peak_api_ok",
                    "memory_stats_keys", "frames_name_this_file", "api_error"]:
            print(f"{key:22s} " + ", ".join(f"{name} {r.get(key)}" for name, r in runs.items()))
        print("CUDA graph replay intact: " + ", ".join(f"{name} {r.get('graph_ok')}" for name, r in runs.items()))
        if "tidepool-expandable" in runs:
            e = runs["tidepool-expandable"]
            print(f"expandable: losses identical {n['losses'] == e['losses']}, step time/native {e['median_step_s'] / n['median_step_s']:.3f}, "
                  f"pages mapped/unmapped after warm-up {e.get('pages_mapped_after_warm_up')}/{e.get('pages_unmapped_after_warm_up')} (target 0/0)")


def models():
    for name in ["native", "native-expandable"]:
        m = json_line(f"model-{name}.json")
        if m is not None and ran(f"model-{name}"):
            recorded = m["pytorch_recorded_peak_reserved_bytes"]
            print(f"model of {name}: peak reserved {m['peak_reserved_bytes'] / 2**30:.3f} GiB, PyTorch recorded "
                  f"{recorded / 2**30:.3f} GiB ({100 * (m['peak_reserved_bytes'] / recorded - 1):+.2f} %)")


guarded("PyTorch end to end", end_to_end)
guarded("models of PyTorch's allocator", models)
bad = [name for name, verdict in sections if not (verdict == "ok" or verdict.startswith("skipped"))]
print(f"sections: {len(sections)}, ok {sum(v == 'ok' for _, v in sections)}, "
      f"skipped {sum(v.startswith('skipped') for _, v in sections)}, not ok {len(bad)}" + (f": {', '.join(bad)}" if bad else ""))
sys.exit(1 if bad else 0)
