"""
The files of `python bench.py --sweep`: the rows as CSV and JSON, and MFU against each shape choice as a PNG
(one panel per axis, one y-range), titled with what a plot read on its own needs.
"""
import csv
import json

import torch
import torch.distributed as dist

from kit import runtime


def sweep_title(cfg, model_cfg, device_type):
    """What a plot read on its own needs: the device, the dtype and the shape every point varies from."""
    name = {"cuda": torch.cuda.get_device_name, "neuron": runtime.trainium_generation}.get(device_type, lambda: "CPU")()
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    c = model_cfg
    return (f"MFU on {device_type} ({name}, {ranks} rank(s)), {cfg.dtype}; base: {c.n_layer} layers, "
            f"n_embd {c.n_embd}, {c.n_head}/{c.n_kv_head} heads, seq {c.sequence_len}, batch {cfg.batch_size}")


def write_sweep(rows, prefix, title):
    with open(f"{prefix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(f"{prefix}.json", "w") as f:
        json.dump(rows, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {prefix}.csv and {prefix}.json (install matplotlib for {prefix}.png)")
        return
    axes_names = list(dict.fromkeys(r["axis"] for r in rows))
    # one y-range for all panels, so a taller curve means a higher MFU, not a different scale
    fig, axes = plt.subplots(1, len(axes_names), figsize=(3.2 * len(axes_names), 3.4), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], axes_names):
        points = [r for r in rows if r["axis"] == name]
        ax.plot([r["value"] for r in points], [100 * r["mfu"] for r in points], "o-")
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MFU %")
    axes[0][0].set_ylim(bottom=0)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{prefix}.png", dpi=100)
    print(f"wrote {prefix}.csv, {prefix}.json and {prefix}.png")
