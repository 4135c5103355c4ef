// Python module object of the CUDA extension `hf_zero._C_cuda`. Importing it runs the static
// TORCH_LIBRARY_IMPL(hf_zero, CUDA, m) registrations of the *_cuda.cu files; the schemas come from hf_zero._C,
// which hf_zero/ops/_native.py always loads first.

#include <Python.h>

extern "C" {
PyObject* PyInit__C_cuda(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_cuda", "hf_zero compiled CUDA ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
}
