"""Sweep the economics of a head and plot them: from a validation.json (acceptance by depth), the predicted
speedup over plain decoding for each chain depth K and draft cost c, and the break-even draft cost; on a GPU a
verify forward of a few tokens costs about one decode step, on a CPU it grows with the tokens verified.

    python examples/economics_sweep.py runs/<name>/validate/validation.json [--out economics.png]"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.runtime.economics import break_even_cost, depth_speedups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validation", help="a validation.json written by `draftsmith validate`")
    parser.add_argument("--out", default="economics.png")
    args = parser.parse_args()
    report = json.loads(open(args.validation).read())
    alphas = report["acceptance_per_depth"]
    measured_verify = (report.get("depth_choice") or {}).get("verify_cost_by_tokens")
    devices = {"GPU-like (verify = 1 step)": [1.0] * (len(alphas) + 1)}
    if measured_verify:
        devices[f"measured on {report['device']}"] = measured_verify
    fig, axes = plt.subplots(1, len(devices), figsize=(5 * len(devices), 3.5), squeeze=False)
    for ax, (name, verify) in zip(axes[0], devices.items()):
        for c in (0.02, 0.05, 0.1, 0.2):
            speedups = depth_speedups(alphas, c, verify)
            ax.plot(list(speedups), list(speedups.values()), marker="o", label=f"c = {c}")
            best = max(speedups, key=speedups.get)
            print(f"{name}, c={c}: best K {best}, predicted {speedups[best]:.2f}x")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=name, xlabel="chain depth K", ylabel="predicted speedup vs plain")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    tau = report["tau"]
    print(f"tau {tau:.2f} at depth {len(alphas)}: speculation pays while a draft step costs under "
          f"{break_even_cost(tau, len(alphas)):.3f} of a target step; plot in {args.out}")


if __name__ == "__main__":
    main()
