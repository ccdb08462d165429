"""The benchmark's Markdown: the settings line, one table row per config, and the sampler, feature extractor,
loader and compile lines (tread/perf/benchmark_run.py makes the results)."""
from __future__ import annotations

from tread.perf.routes import label_of
from tread.perf.units import fmt_bytes, fmt_flops


def result_row(r: dict) -> str:
    routes = label_of(r["routes"])
    label = r["config"] if r["config"] == routes else f"{r['config']} ({routes})"
    mfu_s = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"| {r['model']} | {label} | {fmt_flops(r['train_flops_per_step'])} | {r['flops_ratio']:.3f} | "
            f"{r['step_ms']:.1f} ms | {r['speedup']:.3f}x | {r['speedup_bound']:.3f}x | "
            f"{100 * r['fraction_of_bound']:.1f}% | {r['images_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{fmt_bytes(r['peak_mem_bytes'])} | {mfu_s} |")


def extra_lines(out: dict) -> list[str]:
    lines = []
    samp = out.get("sampling")
    for sm in ([samp] if isinstance(samp, dict) else samp or []):
        lines.append(f"\nSampling {sm['model']}: {sm['sampler']}, {sm['num_steps']} steps ({sm['nfe']} NFE), batch "
                     f"{sm['batch']}: {sm['images_per_s']:.2f} images/s ({sm['ms_per_nfe']:.1f} ms/NFE)")
    if out.get("eval"):
        e = out["eval"]
        lines.append(f"\nEval features {e['features']} at {e['image_size']} px, batch {e['batch']}: "
                     f"{e['images_per_s']:.1f} images/s")
    if out.get("loader"):
        d = out["loader"]
        lines.append(f"\nData loader ({d['data']}, {d['workers']} workers, batch {d['batch']}): {d['ms_per_batch']:.2f} "
                     f"ms per batch ({d['images_per_s']:.0f} images/s); the dense step takes {d['step_ms']:.1f} ms, "
                     f"so a step waits {d['wait_ms_per_step']:.2f} ms for data")
    compiled = [r for r in out["results"] if "compile" in r]
    for i, r in enumerate(compiled):
        c = r["compile"]
        lines.append(f"{'' if i else chr(10)}Compiled ({c['backend']}) {r['model']} {r['config']}: "
                     f"{c['warmup']['unique_graphs']} graphs in the warm-up, {c['graph_breaks']} graph breaks, "
                     f"{c['recompiles_timed']} recompiles while timed")
    lines += bucket_lines(out["results"])
    return lines


def bucket_lines(results: list[dict]) -> list[str]:
    """Per config stepped on --grids: each bucket's tokens, step time and the graphs its first steps compiled."""
    lines = []
    for r in results:
        if r.get("buckets"):
            cells = [f"{'x'.join(map(str, b['grid']))}{' again' if b.get('revisit') else ''} ({b['tokens']} tokens): "
                     f"{b['step_ms']:.1f} ms, {b['warmup']['unique_graphs']} graphs on arrival, "
                     f"{b['timed']['unique_graphs']} while timed" for b in r["buckets"]]
            lines.append(f"{'' if lines else chr(10)}Buckets {r['model']} {r['config']}: " + "; ".join(cells))
    return lines


def markdown(out: dict) -> str:
    s = out["settings"]
    comp = f"compile ({s['compile_backend']})" if s["compile"] else "eager"
    clip = f"clip {s['grad_clip']:g}" if s["grad_clip"] else "no clipping"
    lines = [s["geometry"],
             f"{s['model']}, {s['tokens']} tokens, batch {s['batch']} (accumulation {s['grad_accum_steps']}, lr "
             f"{s['lr']:g}, label dropout {s['label_dropout']:g}, {clip}, EMA {s['ema_decay']:g}); "
             f"{s['device_name']} ({s['device']}), {s['threads']} threads, {s['precision']}, {comp}, "
             f"torch {s['torch']}", "",
             "| model | routes | FLOPs/step | FLOPs ratio | step | speedup | FLOPs bound | of bound | images/s | "
             "tokens/s | peak mem | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [result_row(r) for r in out["results"]] + extra_lines(out)
    if s.get("mfu_note"):
        lines.append(f"\nMFU: {s['mfu_note']}. Peak memory: {s['peak_mem_method']}.")
    return "\n".join(lines)
