"""Layer reduction: ``config`` (schema), ``apply`` (student_initialization, make_student). Not a grouped method:
it runs first in init_compression, when a teacher is given."""

from .apply import default_teacher_layers, make_student, student_initialization
from .config import LayerReductionConfig

__all__ = ["LayerReductionConfig", "student_initialization", "make_student", "default_teacher_layers"]
