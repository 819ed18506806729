"""Combine ``bench_field.py --score-queries a b`` runs into one table per method.

The field table's LDS, same-seed LDS and LOO are means over the test points of
per-test-point correlations (with the retrained margins), so runs that scored
disjoint ranges of the same test points, on the same trained model and ground truth
(``--ground-truth-cache``), combine exactly by their means weighted by the ranges'
sizes. Attribution times add up; the peak memory is the largest. The script checks
that a method's ranges do not overlap and says which test points they cover, and
refuses runs of different settings (rows, steps, subsets, LOO rows, test points).

Run: ``python benchmarks/field_combine.py cfx_0_64.json cfx_64_128.json ...``
(the ``--json`` files of the runs).
"""

import argparse
import json

METRICS = ("lds", "lds_same_seed", "loo")
SETTINGS = ("rows", "epochs", "queries", "subsets", "loo", "path_storage", "dtype")


def scored_points(table):
    """The first and last test point a run scored (earlier runs wrote the number
    of first points, or nothing: all of them)."""
    scored = table.get("scored_queries", table["queries"])
    if isinstance(scored, int):
        return 0, scored - 1
    return tuple(scored)


def combine(runs):
    """``{method: {"points": [(first, last), ...], metric: mean, "time_attr": sum,
    "peak_mib": max}}`` of ``runs`` (the loaded JSON files)."""
    settings = {tuple(run["args"][name] for name in SETTINGS) for run in runs}
    if len(settings) > 1:
        raise ValueError(f"The runs have different settings {SETTINGS}: {sorted(settings)}.")
    found = {}
    for run in runs:
        table = run["results"]["table"]
        first, last = scored_points(table)
        for method, values in table["methods"].items():
            found.setdefault(method, []).append(((first, last), values))
    combined = {}
    for method, parts in found.items():
        parts.sort(key=lambda part: part[0])
        for ((_, last), _), ((first, _), _) in zip(parts, parts[1:], strict=False):
            if first <= last:
                raise ValueError(f"{method}: the ranges overlap at test point {first}.")
        sizes = [last - first + 1 for (first, last), _ in parts]
        total = sum(sizes)
        combined[method] = {
            "points": [span for span, _ in parts],
            "n_points": total,
            **{
                metric: sum(n * values[metric] for n, (_, values) in zip(sizes, parts, strict=True))
                / total
                for metric in METRICS
            },
            "time_attr": sum(values["time_attr"] for _, values in parts),
            "peak_mib": max(values["peak_mib"] for _, values in parts),
        }
    return combined


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="the --json files of bench_field.py runs")
    args = parser.parse_args()
    runs = []
    for name in args.runs:
        with open(name) as handle:
            runs.append(json.load(handle))
    print("| method | test points | LDS | LDS same-seed | LOO | attr. (s) | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for method, row in combine(runs).items():
        spans = ", ".join(f"{first}-{last}" for first, last in row["points"])
        print(
            f"| {method} | {row['n_points']} ({spans}) | {row['lds']:.3f} | "
            f"{row['lds_same_seed']:.3f} | {row['loo']:.3f} | {row['time_attr']:.0f} | "
            f"{row['peak_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
