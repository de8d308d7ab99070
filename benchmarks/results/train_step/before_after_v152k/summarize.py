"""usage: python summarize.py DIR (this folder: before_N.json / after_N.json, or DIR/before_N/train_step.json).

Pool the counted rounds of before_*/after_* train_step.json; per-round lopti/grpo ratios (same pair index, same run)."""
import json, statistics, sys
from pathlib import Path
root = Path(sys.argv[1])
def mm(v):
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "n/a"
for path in ("fused_lm_head", "logits_kernel"):
    row = {}
    for side in ("before", "after"):
        ratios = {"train": [], "step": [], "train_cpu": [], "step_cpu": []}
        lo_cpu, gr_cpu, low, lo_low, lo_high, loads = [], [], [], [], [], []
        for f in sorted(root.glob(f"{side}_*.json")) + sorted(root.glob(f"{side}_*/train_step.json")):
            d = json.load(open(f))
            loads += [d["machine"]["load_average_1m"], d["machine"]["load_average_1m_end"]]
            recs = [r for r in d["records"] if r["counted"] and r["loss_path"] == path]
            by = {(r["method"], r["pair"]): r for r in recs}
            for (m, p), r in by.items():
                if m != "lopti":
                    continue
                g = by[("grpo", p)]
                for k in ratios:
                    ratios[k].append(r[k + "_s"] / g[k + "_s"])
                lo_cpu.append(r["train_cpu_s"]); gr_cpu.append(g["train_cpu_s"]); low.append(r["low_token_fraction"])
                lo_low.append(r["train_low_s"]); lo_high.append(r["train_high_s"])
        row[side] = (ratios, lo_cpu, gr_cpu, low, lo_low, lo_high, loads)
        print(path, side, "n", len(lo_cpu), "train", mm(ratios["train"]), "step", mm(ratios["step"]), "trainCPU", mm(ratios["train_cpu"]),
              "stepCPU", mm(ratios["step_cpu"]), "loptiCPU", mm(lo_cpu), "grpoCPU", mm(gr_cpu), "low", mm(low),
              "phase low/high s", mm(lo_low), mm(lo_high), "load", f"{min(loads):.1f}-{max(loads):.1f}")
