"""Combine ``bench_field.py --score-queries a b`` runs into one table per method.

The field table's LDS, same-seed LDS and LOO are means over the test points of
per-test-point correlations (with the retrained margins), so runs that scored
disjoint ranges of the same test points, on the same trained model and ground truth
(``--ground-truth-cache``), combine exactly by their means weighted by the ranges'
sizes. Attribution times add up; the peak memory is the largest. The script checks
that a method's ranges do not overlap and says which test points they cover, and
refuses runs of different settings (rows, steps, subsets, LOO rows, test points).

Run: ``python benchmarks/field_combine.py cfx_0_64.json cfx_64_128.json ...``
(the ``--json`` files of the runs). ``--quick`` without files combines two made-up
runs of one method (test points 0-3 and 4-11) and checks the weighted means.
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


def made_up_runs():
    """Two runs of one method over test points 0-3 and 4-11, as ``bench_field.py
    --json`` writes them (the numbers are made up)."""
    args = dict(rows=500, epochs=2, queries=12, subsets=6, loo=4, path_storage="memory",
                dtype="float64")  # fmt: skip
    runs = []
    for points, lds, time_attr in (((0, 3), 0.2, 1.0), ((4, 11), 0.5, 2.0)):
        values = dict(lds=lds, lds_same_seed=2 * lds, loo=lds / 2, time_attr=time_attr,
                      peak_mib=100 * time_attr)  # fmt: skip
        table = {"queries": 12, "scored_queries": list(points), "methods": {"ours": values}}
        runs.append({"args": args, "results": {"table": table}})
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="the --json files of bench_field.py runs")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="without files: combine two made-up runs and check the result",
    )
    args = parser.parse_args()
    if not args.runs and not args.quick:
        parser.error("the --json files of bench_field.py runs are needed")
    runs = []
    for name in args.runs:
        with open(name) as handle:
            runs.append(json.load(handle))
    if not runs:
        print("no runs given: two made-up runs of 'ours' (test points 0-3 and 4-11)")
        runs = made_up_runs()
        ours = combine(runs)["ours"]
        assert ours["points"] == [(0, 3), (4, 11)] and ours["n_points"] == 12, ours
        assert abs(ours["lds"] - (4 * 0.2 + 8 * 0.5) / 12) < 1e-12, ours
        assert ours["time_attr"] == 3.0 and ours["peak_mib"] == 200.0, ours
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
