"""The text of a FLOPs profile: DeepSpeed's report layout with hf_zero's counted figures.

Number formatting follows DeepSpeed's (``number_to_string`` and friends), so scripts that parse its strings keep
working; the lines DeepSpeed derives from ``recompute_fwd_factor`` keep its wording, and the counted figures
(backward, model vs hardware FLOPs, MFU) are added beside them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from hf_zero.profiling.flops import ATTENTION_CONVENTION, FlopReport
from hf_zero.profiling.params import true_numel

__all__ = ["number_to_string", "macs_to_string", "flops_to_string", "params_to_string", "duration_to_string",
           "StepFigures", "format_profile"]

PRECISION = 2
_LINE = "{:<70}  {:<8}"


def number_to_string(num: float, units: str | None = None, precision: int = PRECISION) -> str:
    scales = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}
    if units is None:
        for units, magnitude in scales.items():
            if num >= magnitude or (units == "" and num == 0):
                break
        else:
            units = "u"
    return f"{round(num / scales.get(units, 1.0), precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = PRECISION) -> str:
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


@dataclass
class StepFigures:
    """What a profiled training step measured on this rank (latencies in seconds; None when not measured)."""

    profile_step: int
    world_size: int = 1
    dp_size: int = 1
    micro_batch: int | None = None
    micro_steps: int | None = None   # forwards counted in the profiled step (gradient accumulation); None: one call
    params_total: int = 0
    params_resident: int = 0
    params_resident_bytes: int = 0
    fwd_s: float | None = None
    bwd_s: float | None = None
    step_s: float | None = None
    samples: int = 0          # this rank's samples in the profiled step
    tokens: int = 0           # this rank's tokens (attention mask) in the profiled step
    peak_tflops: float | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    recompute_fwd_factor: float = 0.0


def _module_table(root: nn.Module, report: FlopReport) -> list[tuple[str, nn.Module, int, int, int, float]]:
    """(name, module, depth, params, fwd flops, fwd seconds) for every module, root first. A container that is
    never called itself (``ModuleList``) gets the sum of its children, as DeepSpeed's profile shows it."""
    names = {id(m): (n or type(root).__name__) for n, m in root.named_modules()}

    def figures(module: nn.Module) -> tuple[int, float]:
        key = names[id(module)]
        if key in report.by_module or key in report.module_seconds:
            return report.by_module.get(key, 0), report.module_seconds.get(key, 0.0)
        parts = [figures(child) for child in module.children()]
        return sum(f for f, _ in parts), sum(t for _, t in parts)

    rows = []
    for name, module in root.named_modules():
        depth = 0 if not name else name.count(".") + 1
        params = sum(true_numel(p) for p in module.parameters())
        flops, seconds = figures(module)
        rows.append((names[id(module)], module, depth, params, flops, seconds))
    return rows


def format_profile(root: nn.Module, report: FlopReport, figures: StepFigures, *, module_depth: int = -1,
                   top_modules: int = 1, detailed: bool = True) -> tuple[str, list[str]]:
    """The report text and the warnings it raised (``recompute_fwd_factor`` disagreeing with the count)."""
    warnings: list[str] = []
    fwd = report.forward
    out = ["", "-------------------------- DeepSpeed Flops Profiler (hf_zero) --------------------------",
           f"Profile Summary at step {figures.profile_step}:",
           "Notations:\ndata parallel size (dp_size), number of parameters (params), number of multiply-accumulate "
           "operations(MACs),\nnumber of floating-point operations (flops), floating-point operations per second "
           "(FLOPS),\nfwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
           "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
           "Counted by hf_zero at the dispatcher (torch's FLOP formulas): forward and backward are measured, "
           f"not assumed; {ATTENTION_CONVENTION}.\n"]
    line = lambda label, value: out.append(_LINE.format(label, value))  # noqa: E731
    line("world size: ", figures.world_size)
    line("data parallel size: ", figures.dp_size)
    if figures.micro_batch is not None:
        line("batch size per GPU: ", figures.micro_batch)
    if figures.micro_steps is not None:
        # DeepSpeed's figures are of the step's last micro-batch; these cover every micro-batch of the step
        line("micro-batches in this step (every figure below covers them all): ", figures.micro_steps)
    line("params of model (true sizes, every ZeRO stage): ", params_to_string(figures.params_total))
    line("params per GPU (resident at rest on this rank): ",
         f"{params_to_string(figures.params_resident)} "
         f"({figures.params_resident_bytes / 2**20:.2f} MiB)")
    line("fwd MACs per GPU: ", macs_to_string(fwd / 2))
    line("fwd flops per GPU: ", number_to_string(fwd))
    line("bwd flops per GPU (counted): ", number_to_string(report.backward))
    line("model flops per GPU (fwd + bwd, no recompute; for MFU): ", number_to_string(report.model))
    line("hardware flops per GPU (as dispatched, with recompute; for HFU): ", number_to_string(report.hardware))
    factor = 2 + figures.recompute_fwd_factor
    if fwd and report.backward:
        ratio = report.backward / fwd
        if abs(ratio - factor) > 0.1 * factor:
            warnings.append(f"flops_profiler.recompute_fwd_factor {figures.recompute_fwd_factor:g} implies a "
                            f"backward of {factor:g} x forward, but the counted backward is {ratio:.3g} x forward")
    iter_s = None
    if figures.fwd_s:
        line("fwd latency: ", duration_to_string(figures.fwd_s))
        line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(fwd / figures.fwd_s))
    if figures.fwd_s and figures.bwd_s:
        line("bwd latency: ", duration_to_string(figures.bwd_s))
        line(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
             flops_to_string(factor * fwd / figures.bwd_s))
        line("bwd FLOPS per GPU = counted bwd flops per GPU / bwd latency: ",
             flops_to_string(report.backward / figures.bwd_s))
        line(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
             flops_to_string((factor + 1) * fwd / (figures.fwd_s + figures.bwd_s)))
        if figures.step_s is not None:
            line("step latency: ", duration_to_string(figures.step_s))
            iter_s = figures.fwd_s + figures.bwd_s + figures.step_s
            line("iter latency: ", duration_to_string(iter_s))
            line(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                 flops_to_string((factor + 1) * fwd / iter_s))
            line("model FLOPS per GPU = model flops per GPU / iter latency: ", flops_to_string(report.model / iter_s))
            line("samples/second: ", round(figures.samples * figures.dp_size / iter_s, PRECISION))
            if figures.tokens:
                line("tokens/second: ", round(figures.tokens * figures.dp_size / iter_s, PRECISION))
                line("tokens/second per GPU: ", round(figures.tokens / iter_s, PRECISION))
    if iter_s and figures.peak_tflops:
        peak = figures.peak_tflops * 1e12
        line(f"MFU (peak {figures.peak_tflops:g} TFLOPS, {figures.device}, {figures.dtype}): ",
             f"{report.model / iter_s / peak:.4f}")
        line("HFU: ", f"{report.hardware / iter_s / peak:.4f}")
    elif iter_s:
        line("MFU: ", f"not reported: no dense peak known for {figures.device} in {figures.dtype} "
                      f"(set HF_ZERO_PEAK_TFLOPS)")

    rows = _module_table(root, report)
    max_depth = max(r[2] for r in rows)
    depth = max_depth if module_depth == -1 else min(module_depth, max_depth)
    out += ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
            f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(depth + 1):
        per_class: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
        for _, module, row_depth, params, flops, seconds in rows:
            if row_depth == d:
                agg = per_class[type(module).__name__]
                agg[0] += flops // 2
                agg[1] += params
                agg[2] += seconds
        top = lambda i, fmt: {k: fmt(v[i]) for k, v in sorted(per_class.items(),  # noqa: E731
                                                              key=lambda kv: kv[1][i], reverse=True)[:top_modules]}
        out += [f"depth {d}:", f"    params      - {top(1, params_to_string)}",
                f"    MACs        - {top(0, macs_to_string)}", f"    fwd latency - {top(2, duration_to_string)}"]
    if detailed:
        out += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                "Each module: params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
                "percentage of total fwd latency, fwd FLOPS"]
        total_params = rows[0][3] or 1
        total_macs = rows[0][4] // 2 or 1
        total_s = rows[0][5] or 1.0
        for name, module, row_depth, params, flops, seconds in rows:
            if module_depth != -1 and row_depth > module_depth:
                continue
            short = name if row_depth == 0 else name.rsplit(".", 1)[-1]
            out.append(f"{'  ' * row_depth}({short}): {type(module).__name__}({params_to_string(params)} = "
                       f"{100 * params / total_params:.2f}% Params, {macs_to_string(flops / 2)} = "
                       f"{100 * flops / 2 / total_macs:.2f}% MACs, {duration_to_string(seconds)} = "
                       f"{100 * seconds / total_s:.2f}% latency, "
                       f"{flops_to_string(flops / seconds if seconds else 0)})")
    for w in warnings:
        out.append(f"warning: {w}")
    out.append("------------------------------------------------------------------------------")
    return "\n".join(out), warnings

