"""A kernel call's schedule (:func:`._schedule.schedule`) as files a learner can open: a Chrome trace-event JSON
(Perfetto, ui.perfetto.dev, or chrome://tracing) and a PNG.

The JSON follows the Trace Event Format (Google's "Trace Event Format" document, the "Complete events"
``ph: "X"`` with ``ts``/``dur`` in microseconds, and the metadata event ``thread_name``): one process, one
thread (track) per engine or DMA queue used, one complete event per instruction, named for it.
"""

import json
import os

from ._schedule import COMPUTE_TRACKS


def _tracks(slots):
    """The tracks used, compute engines first, then the DMA queues in order."""
    used = {s.track for s in slots}
    dma = sorted((t for t in used if t not in COMPUTE_TRACKS), key=lambda t: int(t.rsplit(" ", 1)[1]))
    return [t for t in COMPUTE_TRACKS if t in used] + dma


def trace_events(trace, result, title):
    """The Trace Event Format object of one schedule (``result``) of ``trace``."""
    trace = result.get("trace", trace)  # as scheduled: with the spill transfers (_spill) where SBUF overflowed
    tracks = _tracks(result["slots"])
    tid = {track: n for n, track in enumerate(tracks)}
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": title}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[t], "args": {"name": t}} for t in tracks]
    events += [{"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid[t], "args": {"sort_index": tid[t]}}
               for t in tracks]
    for slot in result["slots"]:
        i = trace[slot.index]
        events.append({"name": slot.name, "ph": "X", "pid": 0, "tid": tid[slot.track], "ts": 1e6 * slot.start,
                       "dur": 1e6 * (slot.end - slot.start),
                       "args": {"index": slot.index, "partitions": i.partitions, "free": i.free,
                                "dtypes": list(i.dtypes), "buffers": list(i.buffers), "ops": list(i.ops)}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def draw(result, path, title):
    """The schedule as a PNG: one row per track, one bar per instruction (matplotlib, headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tracks = _tracks(result["slots"])
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(tracks) + 1.2))
    colours = plt.get_cmap("tab20")
    names = sorted({s.name for s in result["slots"]})
    for row, track in enumerate(tracks):
        for name in names:
            bars = [(1e6 * s.start, 1e6 * (s.end - s.start)) for s in result["slots"]
                    if s.track == track and s.name == name]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colours(names.index(name) % 20), label=name)
    handles = {h.get_label(): h for h in ax.get_children() if getattr(h, "get_label", None) and h.get_label() in names}
    ax.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds")
    ax.set_title(f"{title}: {1e6 * result['scheduled_s']:.1f} us scheduled", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(trace, result, directory, name, title=None):
    """Write ``name``.json (trace events) and ``name``.png into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    title = title or name
    json_path, png_path = os.path.join(directory, f"{name}.json"), os.path.join(directory, f"{name}.png")
    with open(json_path, "w") as f:
        json.dump(trace_events(trace, result, title), f)
    draw(result, png_path, title)
    return json_path, png_path
