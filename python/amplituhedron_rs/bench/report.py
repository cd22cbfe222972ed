"""Presenting one ``amplituhedron bench`` run: terminal tables, the plot, the Markdown report.

Everything here reads the bench's JSON report (a plain dict), so a saved ``bench.json`` can
be re-rendered without re-running the bench.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

PREDICTIONS = ("p1", "p2", "p3", "p4", "p5")
TRIGGERS = ("f1", "f2", "f3", "f4", "f5")
TRACE_TITLES = {
    "luminary": "(a) Luminary basin (‖tail‖ ≈ 1)",
    "raw": "(b) raw model tails",
    "multi_tenant": "(c) multi-tenant, token hit rate",
    "conversations": "(d) conversations, token hit rate",
}
#: Each eviction policy's column title and plot colour.
POLICY_COLUMNS = (
    ("pisot", "Pisot-guard", "#756bb1"),
    ("lru", "LRU", "#969696"),
    ("gdsf", "cost-aware", "#31a354"),
)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _saved(trace: Mapping[str, Any], policy: str) -> str:
    """Prefill a policy's hits saved on a trace: seconds if measured, else positions."""
    seconds = trace.get("saved_prefill_s")
    if seconds:
        return f"{seconds[policy]:.1f} s"
    return f"{trace['saved_positions'][policy]} positions"


def prediction_numbers(key: str, p: Mapping[str, Any]) -> tuple[str, str]:
    """(measured, threshold) of one prediction, formatted for people."""
    v, t = float(p["value"]), float(p["threshold"])
    if key == "p1":
        return f"{v:.0f}/{t:.0f} sessions", f"all {t:.0f}"
    if key == "p2":
        return f"{_pct(v)} faster", f"≥ {_pct(t)}"
    if key == "p3":
        return f"{v:.2f}×", f"≥ {t:g}×"
    if key == "p4":
        return f"{v:.0f} false hits", "0"
    if key == "p5":
        return f"Pisot {_pct(v)}", f"≥ LRU {_pct(t)}"
    raise ValueError(f"unknown prediction {key!r}")


def _verdict(upheld: bool) -> str:
    return "upheld" if upheld else "FALSIFIED"


def _fired(fired: bool) -> str:
    return "FIRED" if fired else "not fired"


def peer_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(system, cold TPS, warm TPS, uplift) for the mesh and every peer."""
    peers = report["peers"]
    rows = [
        (
            f"mesh, {len(report['mesh']['stations'])} stations (HTTP)",
            f"{peers['mesh']['cold_tps']:.2f}",
            f"{peers['mesh']['warm_tps']:.2f}",
            f"{report['uplift']:.2f}×",
        )
    ]
    for name, label in (
        ("single_process", "single process, no HTTP"),
        ("llamacpp", "llama.cpp, state restore"),
    ):
        p = peers[name]
        if p.get("installed"):
            extra = f" ({p['threads']} threads)" if "threads" in p else ""
            rows.append(
                (
                    label + extra,
                    f"{p['cold']['tps']:.2f}",
                    f"{p['warm']['tps']:.2f}",
                    f"{p['uplift']:.2f}×",
                )
            )
        else:
            rows.append((label, "not installed", "—", p.get("hint", "")))
    return rows


def estimate_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The seeds' §7 estimate beside this run: (quantity, estimate, measured). Decode per
    token divides a session's decode time by the tokens its decode steps produced (the
    first comes from the prefill or the cached logits)."""
    e, cold, warm = report["seed_estimate"], report["cold"], report["warm"]
    steps = max(1, report["prompt"]["new_tokens"] - 1)
    later = [s["latency_ms"] for s in warm["sessions"][1:]] or [warm["median_latency_ms"]]
    return [
        (
            "prefill of the prompt (s)",
            f"{e['prefill_s']:g}",
            f"{cold['median_prefill_ms'] / 1e3:.2f}",
        ),
        (
            "decode (ms / token)",
            f"{e['decode_ms_per_token']:g}",
            f"{warm['median_decode_ms'] / steps:.1f}",
        ),
        (
            "session, cache off (s)",
            f"{e['cold_session_s']:g}",
            f"{cold['median_latency_ms'] / 1e3:.2f}",
        ),
        (
            "session 2+, cache on (s)",
            f"{e['warm_session_s']:g}",
            f"{statistics.median(later) / 1e3:.2f}",
        ),
        ("amortized TPS, cache off", f"{e['cold_tps']:g}", f"{cold['tps']:.2f}"),
        ("amortized TPS, cache on", f"{e['warm_tps']:g}", f"{warm['tps']:.2f}"),
        ("uplift", f"{e['uplift']:g}×", f"{report['uplift']:.2f}×"),
    ]


def estimate_caption(report: Mapping[str, Any]) -> str:
    """Which configuration the estimate is for, and this run's."""
    k = len(report["mesh"]["stations"])
    pr = report["prompt"]
    model = Path(str(report["model"].get("path") or "bundled model")).name
    return (
        f"estimate: {report['seed_estimate']['configuration']}; this run: {model} over {k} "
        f"stations, {pr['prompt_tokens']}-token prompt, {pr['new_tokens']} tokens, "
        f"{report['config']['sessions']} sessions"
    )


def summary_tables(report: Mapping[str, Any]) -> list[Table]:
    """The end-of-run tables: sessions, regimes, verdicts, triggers, eviction, peers."""
    cold, warm, unique = report["cold"], report["warm"], report["unique"]
    k = len(report["mesh"]["stations"])
    pr = report["prompt"]
    sessions = Table(
        title=f"Sessions over {k} stations · {pr['prompt_tokens']}-token prompt "
        f"({pr['system_tokens']}-token system text) · {pr['new_tokens']} greedy tokens"
    )
    for col in ("#", "cache off ms", "cache on ms", "on: replay/prefill/decode", "unique ms"):
        sessions.add_column(col, justify="right")
    for c, w, u in zip(cold["sessions"], warm["sessions"], unique["sessions"], strict=True):
        sessions.add_row(
            str(c["session"]),
            f"{c['latency_ms']:.0f}",
            f"{w['latency_ms']:.0f} {'hit' if w['replay_hit'] else 'miss'}",
            f"{w['replay_ms']:.0f} / {w['prefill_ms']:.0f} / {w['decode_ms']:.0f}",
            f"{u['latency_ms']:.0f} {'HIT' if u['replay_hit'] else 'miss'}",
        )

    regimes = Table(title="Regimes (TPS = generated tokens / summed session latency)")
    for col in ("regime", "median ms", "replay", "prefill", "decode", "TPS"):
        regimes.add_column(col, justify="right")
    for name, r in (("cache disabled", cold), ("cache enabled", warm), ("unique prompts", unique)):
        regimes.add_row(
            name,
            f"{r['median_latency_ms']:.0f}",
            f"{r['median_replay_ms']:.1f}",
            f"{r['median_prefill_ms']:.0f}",
            f"{r['median_decode_ms']:.0f}",
            f"{r['tps']:.2f}",
        )
    be = report["bit_exact"]
    regimes.caption = escape(
        f"uplift {report['uplift']:.2f}× · outputs identical across regimes: "
        f"{'yes' if be['identical'] else 'NO ' + ', '.join(be['mismatches'])} · "
        f"unique regime: {unique['resident_bytes'] / 2**20:.1f} MiB resident, "
        f"latency ×{unique['latency_ratio']:.2f} vs disabled"
    )

    verdicts = Table(title="Predictions")
    for col in ("", "claim", "measured", "threshold", "verdict"):
        verdicts.add_column(col)
    for key in PREDICTIONS:
        p = report[key]
        measured, threshold = prediction_numbers(key, p)
        style = "green" if p["upheld"] else "red"
        verdicts.add_row(
            p["name"],
            escape(p["claim"]),
            measured,
            threshold,
            f"[{style}]{_verdict(p['upheld'])}",
        )

    triggers = Table(title="Falsification triggers")
    for col in ("", "trigger", "fired", "evidence"):
        triggers.add_column(col)
    for key in TRIGGERS:
        f = report[key]
        style = "red" if f["fired"] else "green"
        triggers.add_row(
            f["name"], escape(f["claim"]), f"[{style}]{_fired(f['fired'])}", escape(f["evidence"])
        )

    ev = report["eviction"]
    eviction = Table(
        title="Eviction policies (same traces)", caption=escape(ev["spec"]["description"])
    )
    for col in ("trace", *(title for _, title, _ in POLICY_COLUMNS), "Pisot vs LRU", "best"):
        eviction.add_column(col)
    for name, t in ev["traces"].items():
        eviction.add_row(
            TRACE_TITLES.get(name, name),
            *(_pct(t["hit_rate"][p]) for p, _, _ in POLICY_COLUMNS),
            t["winner"],
            t["best"],
        )

    estimate = Table(
        title="The seeds' §7 estimate beside this run", caption=escape(estimate_caption(report))
    )
    for col in ("", "seeds' estimate", "measured"):
        estimate.add_column(col, justify="right")
    for quantity, estimated, measured in estimate_rows(report):
        estimate.add_row(quantity, estimated, measured)

    peers = Table(title="Side by side (same prompt, same token budget)")
    for col in ("system", "cold TPS", "warm TPS", "uplift"):
        peers.add_column(col)
    for row in peer_rows(report):
        peers.add_row(*(escape(cell) for cell in row))
    return [sessions, regimes, estimate, verdicts, triggers, eviction, peers]


# --- plot ------------------------------------------------------------------------------


def write_plot(report: Mapping[str, Any], path: Path) -> None:
    """Three panels: per-session latency (cache off vs on), TPS with peers, eviction hits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.2))
    cold, warm = report["cold"]["sessions"], report["warm"]["sessions"]
    xs = range(1, len(cold) + 1)
    width = 0.38
    phases: tuple[tuple[str, tuple[str, ...], str], ...] = (
        ("open + replay", ("open_ms", "replay_ms"), "#9ecae1"),
        ("prefill", ("prefill_ms",), "#e6550d"),
        ("decode", ("decode_ms",), "#31a354"),
    )

    def value(session: Mapping[str, Any], keys: tuple[str, ...]) -> float:
        return float(sum(session[k] for k in keys))

    for offset, sessions, hatch, label in (
        (-width / 2, cold, "", "cache off"),
        (width / 2, warm, "//", "cache on"),
    ):
        bottom = [0.0] * len(sessions)
        for name, keys, colour in phases:
            heights = [value(s, keys) for s in sessions]
            ax1.bar(
                [x + offset for x in xs],
                heights,
                width,
                bottom=bottom,
                color=colour,
                hatch=hatch,
                edgecolor="white" if not hatch else "black",
                linewidth=0.3,
                label=f"{label}: {name}",
            )
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax1.set_xticks(list(xs))
    ax1.set_xlabel("session")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title(f"Per-session latency, {len(report['mesh']['stations'])} stations")
    tallest = max(sum(value(s, keys) for _, keys, _ in phases) for s in [*cold, *warm])
    ax1.set_ylim(0, tallest * 1.45)  # room for the legend above the bars
    ax1.legend(fontsize=7, ncol=2, loc="upper right")

    labels, values, colours = [], [], []
    for system, cold_tps, warm_tps, _ in peer_rows(report):
        short = system.split(",")[0].replace("single process", "1 process")
        if cold_tps == "not installed":
            labels.append(f"{short}\n(not installed)")
            values.append(0.0)
            colours.append("#cccccc")
            continue
        labels += [f"{short}\ncold", f"{short}\nwarm"]
        values += [float(cold_tps), float(warm_tps)]
        colours += ["#e6550d", "#31a354"]
    bars = ax2.bar(range(len(values)), values, color=colours)
    for b, v in zip(bars, values, strict=True):
        if v > 0:
            ax2.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    e = report["seed_estimate"]
    for tps, style, what in ((e["cold_tps"], ":", "cold"), (e["warm_tps"], "--", "warm")):
        ax2.axhline(
            tps,
            color="#636363",
            linestyle=style,
            linewidth=1,
            label=f"seeds' §7 estimate, {what}: {tps:g}",
        )
    ax2.legend(fontsize=7, loc="upper right")
    ax2.set_xticks(range(len(labels)))
    ax2.set_xticklabels(labels, fontsize=8)
    ax2.set_ylabel("amortized tokens / s")
    ax2.set_title(f"TPS over {len(cold)} sessions (uplift {report['uplift']:.2f}×)")

    traces = report["eviction"]["traces"]
    names = list(traces)
    bar = width * 2 / len(POLICY_COLUMNS)
    for j, (policy, title, colour) in enumerate(POLICY_COLUMNS):
        rates = [100 * traces[n]["hit_rate"][policy] for n in names]
        pos = [i + (j - (len(POLICY_COLUMNS) - 1) / 2) * bar for i in range(len(names))]
        bars = ax3.bar(pos, rates, bar, color=colour, label=title)
        for b, r in zip(bars, rates, strict=True):
            ax3.annotate(
                f"{r:.0f}", (b.get_x() + b.get_width() / 2, r), ha="center", va="bottom", fontsize=7
            )
    ax3.set_ylim(0, 125)  # room for the legend above the bars
    ax3.set_xticks(range(len(names)))
    ax3.set_xticklabels([TRACE_TITLES.get(n, n) for n in names], fontsize=8)
    ax3.set_ylabel("hit rate (%)")
    spec = report["eviction"]["spec"]
    ax3.set_title(
        f"Eviction: {spec['prefixes']} prefixes, {spec['max_entries']} entries, "
        f"{spec['accesses']}×{len(spec['seeds'])} accesses"
    )
    ax3.legend(fontsize=8, ncol=len(POLICY_COLUMNS), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- Markdown --------------------------------------------------------------------------


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _mean_tokens(regime: Mapping[str, Any]) -> str:
    sessions = regime["sessions"]
    return f"{sum(s['prompt_tokens'] for s in sessions) / len(sessions):.0f}"


def markdown(report: Mapping[str, Any], path: Path, plot: Path | str | None = None) -> str:
    """A short Markdown report; ``plot`` (if any) is linked relative to ``path``'s folder."""
    cfg, pr, k = report["config"], report["prompt"], len(report["mesh"]["stations"])
    out = [
        "# amplituhedron bench — the volume cache's predictions, measured",
        "",
        f"{report['started_at']} · {k} stations ({report['mesh']['kind']} mesh) · "
        f"{cfg['sessions']} sessions per regime · {pr['prompt_tokens']}-token prompt "
        f"({pr['system_tokens']} tokens of system text + a fixed question) · "
        f"{pr['new_tokens']} greedy tokens · "
        f"model fingerprint `{report['model']['fingerprint']}` · "
        f"wall time {report['wall_s']:.0f} s",
        "",
    ]
    if plot:
        rel = os.path.relpath(Path(plot).resolve(), path.resolve().parent)
        out += [f"![per-session latency, TPS with peers, eviction hit rates]({rel})", ""]
    else:
        out += ["(no plot: run with `--plot PATH.png` to embed one)", ""]
    out += ["## Predictions", ""]
    rows = []
    for key in PREDICTIONS:
        p = report[key]
        measured, threshold = prediction_numbers(key, p)
        rows.append([p["name"], p["claim"], measured, threshold, f"**{_verdict(p['upheld'])}**"])
    out += [_md_table(["", "claim", "measured", "threshold", "verdict"], rows), ""]
    out += ["## Falsification triggers", ""]
    rows = [
        [
            report[k2]["name"],
            report[k2]["claim"],
            f"**{_fired(report[k2]['fired'])}**",
            report[k2]["evidence"],
        ]
        for k2 in TRIGGERS
    ]
    out += [_md_table(["", "trigger", "fired", "evidence"], rows), ""]

    out += ["## The seeds' §7 estimate beside this run", "", estimate_caption(report) + ".", ""]
    out += [
        _md_table(["", "seeds' estimate", "measured"], [list(r) for r in estimate_rows(report)]),
        "",
    ]
    cold, warm, unique = report["cold"], report["warm"], report["unique"]
    out += ["## Regimes", ""]
    rows = [
        [
            name,
            f"{r['median_latency_ms']:.0f}",
            f"{r['median_replay_ms']:.1f}",
            f"{r['median_prefill_ms']:.0f}",
            f"{r['median_decode_ms']:.0f}",
            f"{r['tps']:.2f}",
        ]
        for name, r in (
            ("cache disabled", cold),
            ("cache enabled", warm),
            ("unique prompts", unique),
        )
    ]
    out += [_md_table(["regime", "median ms", "replay ms", "prefill ms", "decode ms", "TPS"], rows)]
    be = report["bit_exact"]
    out += [
        "",
        f"- Uplift (enabled / disabled TPS): **{report['uplift']:.2f}×**; session 1 → 2: "
        f"{warm['sessions'][0]['latency_ms']:.0f} ms → {warm['sessions'][1]['latency_ms']:.0f} ms.",
        f"- Output tokens identical in every session of both regimes: "
        f"**{'yes' if be['identical'] else 'no — ' + ', '.join(be['mismatches'])}** "
        f"(“{report['output_text']}”).",
        f"- Unique prompts: {unique['distinct_prompts']} distinct prompts of "
        f"{_mean_tokens(unique)} tokens on average (the shared one: {pr['prompt_tokens']}), "
        f"false hits "
        f"{unique['false_hits']['replies']} (replies) / {unique['false_hits']['stats']} "
        f"(station counters); the cache costs {unique['latency_overhead_ms']:+.0f} ms per "
        f"session at the median (×{unique['latency_ratio']:.2f} vs disabled) and holds "
        f"{unique['resident_bytes'] / 2**20:.1f} MiB in {unique['resident_entries']} entries "
        f"across the stations after {unique['evictions']} evictions.",
        "",
    ]
    ev = report["eviction"]
    out += ["## Eviction policies", "", ev["spec"]["description"] + ".", ""]
    for n in ("multi_tenant", "conversations"):
        if n in ev["traces"]:
            out += [f"{TRACE_TITLES[n]}: {ev['traces'][n]['spec']['description']}.", ""]
    rows = [
        [
            TRACE_TITLES.get(n, n),
            *(_pct(t["hit_rate"][p]) for p, _, _ in POLICY_COLUMNS),
            *(_saved(t, p) for p, _, _ in POLICY_COLUMNS),
            t["winner"],
            t["best"],
        ]
        for n, t in ev["traces"].items()
    ]
    titles = [title for _, title, _ in POLICY_COLUMNS]
    headers = ["trace", *titles, *(f"{t}: prefill saved" for t in titles), "Pisot vs LRU", "best"]
    out += [_md_table(headers, rows), ""]
    out += ["## Side by side", ""]
    out += [
        _md_table(
            ["system", "cold TPS", "warm TPS", "uplift"], [list(r) for r in peer_rows(report)]
        )
    ]
    o = report["oracles"]
    out += [
        "",
        f"Lean oracle parity (F5): {o['passed']}/{o['total']} oracles match"
        + (f"; {o['note']}." if o.get("note") else "."),
        "",
    ]
    return "\n".join(out)


# --- files -----------------------------------------------------------------------------


def write_text(path: Path, text: str) -> None:
    """Writes ``text``, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_json(path: str | None, report: Mapping[str, Any]) -> None:
    """Writes a bench's raw report (if a path was given) and says where."""
    if path:
        write_text(Path(path), json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
