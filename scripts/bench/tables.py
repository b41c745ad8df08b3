"""The bench's table: one row per (case, metric), each part's own labels, ratios and notes."""

from __future__ import annotations

from .parts import PARTS


def _ms(value: float) -> str:
    """A table cell of milliseconds: 2 decimals, none from 100 s (the persona part's 7B
    prompts run to an hour here)."""
    return f"{value:>10.2f}" if value < 1e5 else f"{value:>10.0f}"


def _metric_rows(case: dict, names: tuple[str, ...]) -> list[tuple[str, float, float]]:
    return [(n, case[n]["p50"], case[n]["p95"]) for n in names if case.get(n) is not None]


def format_table(results: list[dict]) -> str:
    """One row per (case, metric): p50, p95, and ours/Kyutai's p50 where both ran."""
    header = f"{'part':<9}{'shape':<19}{'quant':<6}{'impl':<18}{'metric':<14}"
    header += f"{'p50 ms':>10}{'p95 ms':>10}{'ratio':>8}{'peak GB':>9}"
    lines = [header, "-" * len(header)]
    shown: set[int] = set()  # Kyutai's result is shared by the cases of each dtype of ours
    for case in results:
        part = PARTS[case["part"]]
        theirs = case.get("kyutai")
        for impl, data in (("ours", case["ours"]), ("kyutai", theirs)):
            if data is None or id(data) in shown:
                continue
            shown.add(id(data))
            label = "kyutai" if impl == "kyutai" else part.label(data)
            peak = data.get("peak_memory_gb")
            for i, (name, p50, p95) in enumerate(_metric_rows(data, part.metrics(case))):
                if impl == "ours" and theirs is not None and theirs.get(name) is not None:
                    ratio = f"{p50 / theirs[name]['p50']:.2f}"
                else:
                    ratio = part.ratio(name, data)
                row = f"{case['part']:<9}{case.get('shape', '-'):<19}{case.get('quant', '-'):<6}"
                row += f"{label:<18}{name:<14}{_ms(p50)}{_ms(p95)}{ratio:>8}"
                row += f"{peak:>9.2f}" if (i == 0 and peak is not None) else f"{'':>9}"
                lines.append(row)
            lines.extend(part.notes(label, data, case))
    return "\n".join(lines)


def case_lines(case: dict) -> str:
    """A case as it is measured: its part's summary, or its rows of the table."""
    part = PARTS[case["part"]]
    return part.summary(case) if part.summary else format_table([case]).split("\n", 2)[2]


def final_table(results: list[dict]) -> str:
    """The table of every case whose part has no summary of its own."""
    return format_table([case for case in results if PARTS[case["part"]].summary is None])
