// Schemas of every hf_zero op and the Python module object of the CPU extension `hf_zero._C`.
//
// Kernels live beside their op family (adam/, norm/, reduce/, transformer/, common/) and register with
// TORCH_LIBRARY_IMPL(hf_zero, CPU|CUDA, m). Fake (meta) implementations and autograd formulas are registered
// from Python in hf_zero/ops/, next to the pure-PyTorch reference of each op.

#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing hf_zero._C runs the static TORCH_LIBRARY initializers of this shared object; the module itself is
// empty. No pybind11: the ops are reached through torch.ops.hf_zero.*.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "hf_zero compiled CPU ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(hf_zero, m) {
  // out = x + alpha * y: the smallest op that exercises build, load, dispatch, fake and autograd end to end.
  m.def("scale_add(Tensor x, Tensor y, float alpha) -> Tensor");

  // One fused Adam/AdamW step over a flat fp32 partition. grad (fp32|bf16|fp16) is divided by grad_scale;
  // out16 (bf16|fp16), when given, receives the updated parameter cast to 16 bit in the same pass.
  m.def(
      "adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? out16, "
      "int step, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, "
      "bool bias_correction, float grad_scale) -> ()");
  // The same step over many tensors at once (one launch on CUDA); all params fp32.
  m.def(
      "multi_tensor_adam(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "int step, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, "
      "bool bias_correction, float grad_scale) -> ()");

  // One Adagrad step (DeepSpeedCPUAdagrad / torch.optim.Adagrad, L2 weight decay) over a flat fp32 partition.
  m.def(
      "adagrad_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg_sq, Tensor(c!)? out16, float lr, float eps, "
      "float weight_decay, float grad_scale) -> ()");
  // One Lion step (DeepSpeedCPULion, decoupled weight decay) over a flat fp32 partition.
  m.def(
      "lion_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!)? out16, float lr, float beta1, "
      "float beta2, float weight_decay, float grad_scale) -> ()");

  // sum(x.float() ** 2) over all elements as a 0-dim fp32 tensor; inf / nan propagate (fp16 overflow detection).
  m.def("sum_of_squares(Tensor x) -> Tensor");

  // Norms over the last dimension. mean / rstd are fp32, one per row, saved for the backward.
  m.def("layer_norm_fwd(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor out, Tensor mean, Tensor rstd)");
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor x, Tensor mean, Tensor rstd, Tensor weight) "
      "-> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "add_layer_norm_fwd(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) "
      "-> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)");
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor out, Tensor rstd)");
  m.def("rms_norm_bwd(Tensor grad_out, Tensor x, Tensor rstd, Tensor weight) -> (Tensor grad_x, Tensor grad_weight)");
  m.def("add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor out, Tensor sum, Tensor rstd)");

  // Transformer-block ops. approximate is "none" (erf) or "tanh", as in torch.nn.functional.gelu.
  m.def("bias_gelu(Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def("bias_gelu_bwd(Tensor grad_out, Tensor x, Tensor? bias, str approximate) -> Tensor");
  // softmax(x * scale) over the last dim; mask (bool, broadcastable to x, True = masked out) optional.
  // A row with every position masked yields zeros.
  m.def("scaled_masked_softmax(Tensor x, Tensor? mask, float scale) -> Tensor");
  m.def("scaled_softmax_bwd(Tensor grad_out, Tensor out, float scale) -> Tensor");
  // HF Llama rotary embedding: x * cos + rotate_half(x) * sin, cos/sin broadcastable to x.
  m.def("apply_rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("apply_rotary_bwd(Tensor grad_out, Tensor cos, Tensor sin) -> Tensor");
}
