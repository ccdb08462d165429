"""The route plan as Markdown: the header lines (geometry, model, candidates, timing), the candidate table, the
recommendation with the rule and its train command, and the pilot's table (tread/perf/planner.py makes the plan)."""
from __future__ import annotations

from tread.perf.plan import RULE
from tread.perf.units import fmt_flops


def target_text(t: dict) -> str:
    parts = []
    if t.get("speedup") is not None:
        parts.append(f"step speedup >= {t['speedup']:g}x")
    if t.get("flops_fraction") is not None:
        parts.append(f"training FLOPs <= {t['flops_fraction']:g} x dense")
    if t.get("gflops_per_sample") is not None:
        parts.append(f"training GFLOPs/sample <= {t['gflops_per_sample']:g}")
    return " and ".join(parts)


def header_lines(res: dict) -> list[str]:
    s, t = res["settings"], res["target"]
    stopped = "; stopped early: no untimed candidate could change the pick" if res["timing_stopped_early"] else ""
    lines = [s["geometry"],
             f"Route plan for {s['model_name']} (model={s['model']}), {s['tokens']} tokens "
             f"({s['resolution']}x{s['resolution']}x{s['channels']}), depth {s['depth']}, batch {s['batch']}; "
             f"target: {target_text(t)}.",
             f"Candidates: single routes, ratios {', '.join(f'{r:g}' for r in s['ratios'])}, blocks "
             f"{s['span'][0]}..{s['span'][1]} (start >= {s['min_start']}, end <= {s['max_end']}), >= "
             f"{s['min_blocks']} blocks: {res['num_candidates']} candidates, {res['num_meet_theory']} meet the "
             f"target by FLOPs; {res['num_measured']} timed (--measure {s['measure']}{stopped})."]
    if s.get("context_parallel", 1) > 1:
        d = s["context_parallel"]
        lines.append(f"Context parallelism over {d} processes: {s['tokens'] // d} tokens per process; the last "
                     f"column is what one process sends per sample and step by Ulysses all-to-all (bf16; forward, "
                     f"checkpointed recompute, backward): dense {res['dense']['exchange_bytes'] / 1e9:.3g} GB.")
    if res["num_measured"]:
        lines.append(f"Timing: THE training step on {s['device_name']} ({s['device']}), {s['threads']} threads, "
                     f"{s['precision']}, {'compiled' if s['compile'] else 'eager'}; per pairing {s['warmup']} warm-up "
                     f"+ {s['steps']} timed steps per config in {s['rounds']} interleaved rounds with dense; "
                     f"torch {s['torch']}.")
    return lines


def candidate_row(c: dict, rec: str) -> str:
    name = f"**{c['label']}** (recommended)" if c["label"] == rec else c["label"]
    if c.get("measured"):
        timed = (f"{c['step_ms']:.1f} ms | {c['speedup']:.3f}x | {100 * c['fraction_of_bound']:.0f}% | "
                 f"{'yes' if c['meets_measured'] else 'no'}")
    elif c.get("same_cost_as"):
        timed = f"not timed (same work as {c['same_cost_as']}) | - | - | -"
    else:
        timed = "not timed | - | - | -"
    return (f"| {c['rule_rank'] or '-'} | {name} | {100 * c['tokens_fraction']:.1f}% | "
            f"{fmt_flops(c['train_flops_per_step'])} | {c['flops_ratio']:.3f} | {c['speedup_bound']:.3f}x | "
            f"{'yes' if c['meets_theory'] else 'no'} | {timed} |" + exchange_cell(c))


def exchange_cell(row: dict) -> str:
    """The all-to-all column (--context-parallel): GB one process sends per sample and step; none without it."""
    return f" {row['exchange_bytes'] / 1e9:.3g} |" if "exchange_bytes" in row else ""


def pilot_lines(p: dict) -> list[str]:
    what = "FID at the end" if p["metric"] == "final_fid" else "final loss (mean over the second half)"
    budget = " and ".join(([f"{p['steps']} steps"] if p["steps"] else []) +
                          ([f"{p['seconds']:g} s of training"] if p["seconds"] else []))
    first = " (whichever comes first)" if p["steps"] and p["seconds"] else ""
    lines = ["", f"Pilot: {budget} each{first}, ranked by {what}; speedup = steps per training second vs dense.",
             "", "| rank | route | steps | final loss | FID | train s | speedup | meets target |",
             "|---|---|---|---|---|---|---|---|"]
    for x in p["runs"]:
        fid = "-" if x["final_fid"] is None else f"{x['final_fid']:.2f}"
        loss = "-" if x["final_loss"] is None else f"{x['final_loss']:.4f}"
        meets = "-" if x["meets_target"] is None else ("yes" if x["meets_target"] else "no")
        lines.append(f"| {x['rank']} | {x['label']} | {x['steps']} | {loss} | {fid} | {x['train_sec']:.1f} | "
                     f"{x['speedup']:.2f}x | {meets} |")
    lines.append(f"\nPilot pick: **{p['best']}** (best routed candidate by the pilot metric; dense ranks "
                 f"{p['dense_rank']}).")
    return lines


def markdown(res: dict) -> str:
    s, d, r = res["settings"], res["dense"], res["recommendation"]
    extra = (" all-to-all / process (GB) |", "---|") if "exchange_bytes" in d else ("", "")
    lines = header_lines(res) + [
        "", "| # | route | tokens processed | train FLOPs/step | FLOPs ratio | bound | meets (FLOPs) | step | "
        "speedup | of bound | meets (timed) |" + extra[0], "|---|---|---|---|---|---|---|---|---|---|---|" + extra[1]]
    dense_t = f"{d['step_ms']:.1f} ms | 1.000x" if d.get("step_ms") is not None else "- | -"
    lines.append(f"| - | dense | 100.0% | {fmt_flops(d['train_flops_per_step'])} | 1.000 | 1.000x | - | {dense_t} | "
                 f"- | - |" + exchange_cell(d))
    shown = [c for c in res["candidates"] if c["meets_theory"]][:s["show"]]
    shown += [c for c in res["candidates"] if c.get("measured") and c not in shown]
    lines += [candidate_row(c, r["label"]) for c in shown]
    more = res["num_meet_theory"] - len([c for c in shown if c["meets_theory"]])
    if more > 0:
        lines.append(f"\n{more} more candidates meet the target by FLOPs (not shown, not timed; all in --json).")
    verdict = "meets the target" if r["meets_target"] else "does NOT meet the target (closest)"
    lines += ["", f"Recommendation ({r['basis']}): **{r['label']}**, {verdict}: {r['reason']}.",
              f"Rule: {RULE}.", f"Train it: `{r['train_command']}`"]
    if s["usual_data"]:
        lines[-1] += f" (plus data.path=<your {s['usual_data']} latents>)"
    if res.get("pilot"):
        lines += pilot_lines(res["pilot"])
    return "\n".join(lines)
