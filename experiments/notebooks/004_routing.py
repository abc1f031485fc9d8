# %% [markdown]
# # 004 · Top-K routing: one fused kernel vs the eager way
#
# **Seed 004** (FlashInfer PR 4152, an NVIDIA GPU): TRT-LLM-gen's routing kernel kept K
# registers per lane in warp 0; a lane-owned parallel top-K lets large E x K shapes use every
# lane. Reported: **+66.51% (20.473 -> 12.296 µs, 1.665x)** at E=896, K=16, 512 tokens with
# SigmoidBias + ScaledSumNormalize; **0-28%** on the other affected shapes; **10-20% or more**
# on "typical heavy workloads".
#
# **Here** (CPU): `optimized.route(logits, K, "sigmoid_bias", bias=..., scaling=...)` (one moelab
# kernel: sigmoid, + bias, exact top-K with ties to the lower index, gather, normalise) against
# the eager PyTorch way a user writes (`sigmoid`, `+ bias`, `torch.topk`, `gather`, normalise),
# side by side, across E = 128..2048, K = 1..32 and T, bf16 logits as a bf16 model's router
# hands them over. A loose analogue: the seed compares two GPU kernels, we compare a fused CPU
# kernel with a chain of eager ops, and the TRT-LLM routing time also includes the permutation.

# %%
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from IPython.display import display

import optimized
from experiments import nb, timing
from experiments.cases_route import _eager_sigmoid_bias as eager_route

NAME = "004_routing"
stamp = nb.setup(NAME)
display(nb.claims_frame(NAME))

# %%
ES = nb.pick([128, 896], [128, 256, 512, 896, 1024, 2048], [128, 256, 384, 512, 768, 896, 1024, 2048])
KS = nb.pick([1, 16], [1, 4, 8, 10, 16, 32], [1, 2, 4, 8, 9, 10, 12, 16, 24, 32])
TS = nb.pick([1, 512], [1, 16, 128, 512, 2048], [1, 8, 16, 64, 128, 512, 2048, 8192])
ROUNDS = nb.pick(1, 3, 5)
MIN_TIME = nb.pick(0.002, 0.01, 0.03)
SCALING = 2.5
points = [(E, K, T) for E in ES for K in KS for T in TS if K <= E]
if (896, 16, 512) not in points:
    points.append((896, 16, 512))
print(f"{len(points)} points: E in {ES}, K in {KS}, T in {TS}; {ROUNDS} rounds")

g = torch.Generator().manual_seed(4)
rows = []
for E, K, T in points:
    x = torch.randn(T, E, generator=g).bfloat16()
    bias = torch.randn(E, generator=g) * 0.1
    t = timing.compare({
        "eager (sigmoid, topk, gather)": lambda: eager_route(x, bias, K, SCALING),
        "optimized.route": lambda: optimized.route(x, K, "sigmoid_bias", bias=bias, scaling=SCALING),
    }, rounds=ROUNDS, min_time=MIN_TIME)
    base, ours = t["eager (sigmoid, topk, gather)"], t["optimized.route"]
    sp, lo, hi = timing.ratio(base, ours)
    rows.append({"E": E, "K": K, "T": T, "eager_us": base.median * 1e6, "ours_us": ours.median * 1e6,
                 "eager_iqr_us": base.iqr * 1e6, "ours_iqr_us": ours.iqr * 1e6,
                 "speedup": sp, "speedup_min": lo, "speedup_max": hi})
df = pd.DataFrame(rows)
nb.write_results(NAME, df)
print(df.round(2).to_string(index=False))

# %% [markdown]
# ## Figures
# Speedup of the kernel over the eager chain for every (E, K), one panel per T; and the time
# of both at the seed's headline shape family (K = 16) across E.

# %%
fig, axes = plt.subplots(1, len(TS), figsize=(4.6 * len(TS), 4), squeeze=False)
vmax = df["speedup"].max()
for ax, T in zip(axes[0], TS):
    piv = df[df["T"] == T].pivot(index="K", columns="E", values="speedup")
    sns.heatmap(piv, annot=True, fmt=".1f", cmap="viridis", vmin=1 if df["speedup"].min() >= 1 else None,
                vmax=vmax, ax=ax, cbar_kws={"label": "speedup over eager (x)"})
    ax.set(title=f"T = {T} tokens", xlabel="experts E", ylabel="top-K")
    ax.invert_yaxis()
fig.suptitle(f"004: optimized.route (sigmoid_bias) vs eager PyTorch, {stamp['cpu']}, {stamp['threads']} threads, "
             f"ISA {stamp['isa']}", fontsize=10)
fig.tight_layout()
nb.save_figure(fig, "004_routing_heatmap")
plt.show()

# %%
k16 = df[df["K"] == (16 if 16 in KS else max(KS))]
long = k16.melt(id_vars=["E", "T"], value_vars=["eager_us", "ours_us"], var_name="impl", value_name="us")
long["impl"] = long["impl"].map({"eager_us": "eager torch.topk chain", "ours_us": "optimized.route"})
long["T"] = "T=" + long["T"].astype(str)
fig, ax = plt.subplots(figsize=(8.5, 4.5))
sns.lineplot(long, x="E", y="us", hue="T", style="impl", marker="o", ax=ax)
ax.set(yscale="log", xlabel="experts E (log)", ylabel="time per call (µs, log)",
       title=f"route, sigmoid_bias, K = {k16['K'].iloc[0]}, bf16 logits")
nb.log_ticks(ax, ES)
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
ax.axvline(896, color="red", ls=":", lw=1)
nb.save_figure(fig, "004_routing_k16")
plt.show()

# %% [markdown]
# ## GPU results (when present)
# scripts/gpu_check.sh times the moelab GPU route kernel against eager torch.topk at
# E=896/K=16/T=512 and other shapes; shown beside the CPU numbers.

# %%
gpu = nb.gpu_speedups("route", "moelab", "before")
if len(gpu):
    display(gpu)

# %% [markdown]
# ## Verdict

# %%
h = df[(df["E"] == 896) & (df["K"] == 16) & (df["T"] == 512)].iloc[0]
why = ("loose CPU analogue: a fused CPU kernel vs a chain of eager PyTorch ops (the seed: a lane-owned vs a "
       "warp-0 GPU top-K); the eager chain writes f32 copies and runs torch.topk, so the gain here is mostly "
       "fusion, and it is far larger than the seed's kernel-vs-kernel gain")
other = df[df["E"].isin([256, 512, 896]) & df["K"].isin([8, 10, 16])]
heavy = df[df["E"].between(512, 1024) & df["K"].between(9, 16) & (df["T"] >= 16)]
gpu896 = gpu[gpu["case"].str.startswith("E=896 K=16 T=512")] if len(gpu) else gpu
verdicts = [
    nb.verdict_row("004-896-16-512", nb.spread_text(h.speedup, h.speedup_min, h.speedup_max) +
                   f" ({h.eager_us:.1f} -> {h.ours_us:.1f} us)", h.speedup,
                   nb.judge(h.speedup, nb.claim("004-896-16-512")["ratio"]), why,
                   gpu=(f"{gpu896['speedup'].iloc[0]:.2f}x vs eager torch.topk on {gpu896['gpu'].iloc[0]}"
                        if len(gpu896) else "")),
    nb.verdict_row("004-other-shapes", f"geomean {nb.geomean(other['speedup']):.2f}x, min {other['speedup'].min():.2f}x "
                   f"over {len(other)} points (E in 256/512/896, K in 8/10/16, T in {TS})",
                   other["speedup"].min(), nb.judge(other["speedup"].min(), *nb.claim("004-other-shapes")["ratio_range"]),
                   why + "; judged on the minimum (the claim is 'not slower, up to 28% faster')"),
    nb.verdict_row("004-typical-heavy", f"geomean {nb.geomean(heavy['speedup']):.2f}x "
                   f"({heavy['speedup'].min():.2f}..{heavy['speedup'].max():.2f}) over {len(heavy)} points "
                   f"(E 512..1024, K 9..16, T >= 16)", nb.geomean(heavy["speedup"]),
                   nb.judge(nb.geomean(heavy["speedup"]), *nb.claim("004-typical-heavy")["ratio_range"]), why),
]
display(nb.write_verdicts(NAME, verdicts))
