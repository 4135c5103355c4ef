"""``layer_reduction``: a student with fewer layers, initialized from chosen teacher layers (DeepSpeed's flat form)."""

from __future__ import annotations

import dataclasses

from hf_zero.config.errors import ConfigError
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

    def validate(self, path: str) -> None:
        """Checks made when the section is parsed (the grouped methods' ``validate``); the ones that need the
        student and the teacher are made by ``student_initialization``."""
        if not self.enabled:
            return
        if self.keep_number_layer is None or self.keep_number_layer < 1:
            raise ConfigError(f"{path}.keep_number_layer", f"must be a positive integer when enabled, got "
                                                           f"{self.keep_number_layer!r}")
        if self.teacher_layer and len(self.teacher_layer) != self.keep_number_layer:
            raise ConfigError(f"{path}.teacher_layer", f"lists {len(self.teacher_layer)} layers but "
                                                       f"keep_number_layer is {self.keep_number_layer}")
        if any(i < 0 for i in self.teacher_layer):
            raise ConfigError(f"{path}.teacher_layer", f"layer indices must be >= 0, got {list(self.teacher_layer)}")
