"""Print the 8 x H100 estimates table of docs/scaling.md from `minigpt estimate --json` (run from the repo root).

Paper estimates only: per-GPU memory from the estimator's accounting, throughput = 8 GPUs x 989 TFLOP/s (H100 SXM
dense bf16, NVIDIA datasheet) x an assumed MFU / training FLOPs per token.
"""
import json
import subprocess

specs = {
 "medium (vocab 32,000)": "--preset medium --set vocab_size=32000 --train-seq-len 1024 --train-batch 16",
 "1 B (dim 2048, 16 layers, 32/8 heads, hidden 8192, vocab 32,000)": "--preset tiny --set dim=2048 --set n_layers=16 --set n_heads=32 --set n_kv_heads=8 --set hidden_dim=8192 --set vocab_size=32000 --set max_seq_len=2048 --train-seq-len 2048 --train-batch 8",
}
GPUS, PEAK = 8, 989e12  # H100 SXM dense bf16 (NVIDIA datasheet)
rows = []
for name, spec in specs.items():
    out = subprocess.run(f".venv/bin/minigpt estimate {spec} --dtype bfloat16 --json".split(), capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    p = d["parameters"]["total"]; fpt = d["flops"]["training_per_token"]; m = d["training_memory"]
    n, c = m["no_checkpointing"], m["checkpointing"]
    states = n["weights"] + n["gradients"] + n["adam"]
    layer_params = (d["parameters"]["attention"] + d["parameters"]["ffn"]) / d["config"]["n_layers"]
    ddp = states + n["autocast_copies"] + n["activations"]
    fsdp = states / GPUS + 2 * layer_params * 2 + n["activations"]  # + two gathered bf16 blocks (prefetch)
    fsdp_ac = states / GPUS + 2 * layer_params * 2 + c["activations"]
    for mfu in (0.3, 0.4):
        tps = GPUS * PEAK * mfu / fpt
        rows.append((name, p, fpt, m["batch"], m["seq_len"], ddp, fsdp, fsdp_ac, mfu, tps, 10e9 / tps / 86400, 100e9 / tps / 86400))
    print(f"<!-- minigpt estimate {spec} --dtype bfloat16 -->")
G = 2**30
print("| model | params | training FLOPs/token | micro-batch per GPU | DDP GiB/GPU | FSDP GiB/GPU | FSDP + act. ckpt GiB/GPU | MFU | tokens/s (8 GPUs) | days for 10 B tokens | days for 100 B tokens |")
print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f"| {r[0]} | {r[1]/1e6:,.0f} M | {r[2]:.3g} | {r[3]} x {r[4]} | {r[5]/G:.1f} | {r[6]/G:.1f} | {r[7]/G:.1f} | {r[8]:.0%} | {r[9]:,.0f} | {r[10]:.2f} | {r[11]:.1f} |")
