"""``layer_reduction``: a student with fewer layers, initialized from chosen teacher layers (DeepSpeed's flat form)."""

from __future__ import annotations

import dataclasses

from hf_zero.config.schema import spec

__all__ = ["LayerReductionConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerReductionConfig:
    enabled: bool = spec(False, help="initialize the student from teacher layers")
    keep_number_layer: int | None = spec(None, help="layers the student keeps")
    module_name_prefix: str | None = spec(None, help="name of the layer list, e.g. 'model.layers'; default: "
                                                     "found in the model")
    teacher_layer: tuple[int, ...] = spec((), help="teacher layer index copied into each student layer; "
                                                   "default: evenly spaced")
    other_module_name: tuple[str, ...] = spec((), help="other modules copied from the teacher (embeddings, "
                                                       "final norm, head); default: every module outside the "
                                                       "layer list")
