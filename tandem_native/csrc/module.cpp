// The Python module of Tandem's one native library (tandem_native/build.py builds every file of this folder into
// it). Each file registers its operators in the `tandem` op namespace itself (TORCH_LIBRARY_FRAGMENT) and its
// direct Python entry points here.
#include <torch/extension.h>

void register_decode_runner(pybind11::module_& m);
void register_dot_gemm(pybind11::module_& m);
void register_int8_gemv(pybind11::module_& m);
void register_lora(pybind11::module_& m);
void register_paged_attention(pybind11::module_& m);
void register_row_gemm(pybind11::module_& m);
void register_sampling(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_runner(m);
  register_dot_gemm(m);
  register_int8_gemv(m);
  register_lora(m);
  register_paged_attention(m);
  register_row_gemm(m);
  register_sampling(m);
}
