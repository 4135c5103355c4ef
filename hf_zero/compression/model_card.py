"""A model card for a compressed model: what was done to it, and the measured size, speed and quality of every
variant against the baseline. Numbers are passed in (measured with :mod:`hf_zero.compression.measure`), never
estimated here."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Sequence

from hf_zero.config.schema import to_dict

from .compress import load_compression_config

__all__ = ["Measurement", "write_model_card", "render_model_card"]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One row of the results table. ``linear_nbytes`` is optional (bytes of linear weights and scales)."""

    name: str
    size_bytes: int
    latency_s: float
    perplexity: float
    linear_nbytes: int | None = None
    note: str = ""


def _config_json(config: Any) -> str:
    if config is None:
        return "{}"
    cfg = load_compression_config(config)
    enabled = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if section is None:
            continue
        data = to_dict(section)
        if f.name != "layer_reduction":
            data = {"shared_parameters": data["shared"],
                    "different_groups": {g["name"]: {k: v for k, v in g.items() if k in ("params", "modules",
                                                                                          "related_modules") and v}
                                         for g in data["groups"]}}
        enabled[f.name] = data
    return json.dumps({"compression_training": enabled}, indent=2, default=str)


def render_model_card(*, title: str, base_model: str, steps: Sequence[str], results: Sequence[Measurement],
                      compression_config: Any = None, eval_data: str = "", latency_setup: str = "",
                      notes: Sequence[str] = ()) -> str:
    base = results[0]
    rows = ["| variant | size on disk | base / size | linear weights | CPU latency | speed-up | perplexity | "
            "perplexity change |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lin = f"{r.linear_nbytes / 2**20:.2f} MiB" if r.linear_nbytes is not None else "-"
        if r.linear_nbytes is not None and base.linear_nbytes and r is not base:
            lin += f" ({base.linear_nbytes / r.linear_nbytes:.2f}x smaller)"
        rows.append(f"| {r.name} | {r.size_bytes / 2**20:.2f} MiB | {base.size_bytes / r.size_bytes:.2f}x | "
                    f"{lin} | {r.latency_s * 1e3:.1f} ms | {base.latency_s / r.latency_s:.2f}x | "
                    f"{r.perplexity:.3f} | {100 * (r.perplexity / base.perplexity - 1):+.2f}% |")
    tags = ["hf_zero", "compression"]
    text = "\n".join(steps).lower()
    for word in ("int8", "quantiz", "prun", "distil"):
        if word in text:
            tags.append({"quantiz": "quantization", "prun": "pruning", "distil": "distillation"}.get(word, word))
    out = ["---", "library_name: transformers", "tags:", *[f"- {t}" for t in dict.fromkeys(tags)], "---", "",
           f"# {title}", "", f"Compressed from **{base_model}** with `hf_zero.compression` "
           f"on {datetime.date.today().isoformat()}.", "", "## What was done", "",
           *[f"{i + 1}. {s}" for i, s in enumerate(steps)], "", "## Measured results", "", *rows, ""]
    if eval_data or latency_setup:
        out += ["How measured:", ""]
        if eval_data:
            out.append(f"- perplexity: {eval_data}")
        if latency_setup:
            out.append(f"- latency: {latency_setup}")
        out.append("- size on disk: the state dict written as one safetensors file")
        out.append("")
    notes = [n for n in (r.note for r in results) if n] + list(notes)
    if notes:
        out += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    if compression_config is not None:
        out += ["## Compression config", "", "```json", _config_json(compression_config), "```", ""]
    return "\n".join(out)


def write_model_card(save_dir: str, **kwargs: Any) -> str:
    """Render the card (see :func:`render_model_card`) to ``save_dir/README.md``; returns the path."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, "README.md")
    with open(path, "w") as f:
        f.write(render_model_card(**kwargs))
    return path
