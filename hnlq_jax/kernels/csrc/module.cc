// hnlq_jax.kernels._cpu: the native CPU kernels' XLA FFI handlers as PyCapsules, registered
// with jax.ffi.register_ffi_target by hnlq_jax.kernels.cpu, and the same kernels called
// directly on host buffers (decode, decode_matmul, rotate: for the torch bridge, no XLA
// dispatch).
// One kernel per source file; this file only lists them and parses the direct calls.

#include <Python.h>

#include "decode_rows.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HnlqDecode(XLA_FFI_CallFrame* frame);
extern "C" XLA_FFI_Error* HnlqDecodeMatmul(XLA_FFI_CallFrame* frame);
extern "C" XLA_FFI_Error* HnlqLutMatmul(XLA_FFI_CallFrame* frame);
extern "C" XLA_FFI_Error* HnlqRotate(XLA_FFI_CallFrame* frame);

namespace {

struct Target {
  const char* name;
  XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*);
};

constexpr Target kTargets[] = {
    {"hnlq_decode", HnlqDecode},
    {"hnlq_decode_matmul", HnlqDecodeMatmul},
    {"hnlq_lut_matmul", HnlqLutMatmul},
    {"hnlq_rotate", HnlqRotate},
};

// The codes' part of a direct call's arguments (hnlq_jax.kernels.cpu._direct): addresses of
// C-contiguous host buffers as integers, their sizes, the attributes, K and the thread count.
constexpr char kCodesFormat[] = "KpLLLKLKKLKKffLLppLLL";

struct DirectArgs {
  unsigned long long index, tfield, scale, codebook, pow2, dither;
  int u16, t4, bf16;
  long long N, nb, M, tb, d, q, qd, mode, K, threads;
  float beta, cart;

  hnlq::CodesView view() const {
    const bool has_scale = scale != 0;
    return hnlq::CodesView{reinterpret_cast<const void*>(index), u16 != 0, N, nb, M,
                           reinterpret_cast<const uint8_t*>(tfield), N, tb,
                           reinterpret_cast<const float*>(scale), has_scale ? N : 0,
                           reinterpret_cast<const int8_t*>(codebook),
                           hnlq::codebook_rows(mode, u16 != 0), d,
                           reinterpret_cast<const float*>(pow2), 256,
                           reinterpret_cast<const float*>(dither), d};
  }
  hnlq::Attrs attrs() const {
    return hnlq::Attrs{beta, cart, q, qd, t4 != 0, bf16 != 0, mode};
  }
};

PyObject* finish(const std::string& error) {
  if (!error.empty()) {
    PyErr_SetString(PyExc_ValueError, error.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// decode(w, <codes>): w f32[N, K].
PyObject* Decode(PyObject*, PyObject* args) {
  unsigned long long w;
  DirectArgs a{};
  if (!PyArg_ParseTuple(args, (std::string("K") + kCodesFormat).c_str(), &w, &a.index, &a.u16,
                        &a.N, &a.nb, &a.M, &a.tfield, &a.tb, &a.scale, &a.codebook, &a.d,
                        &a.pow2, &a.dither, &a.beta, &a.cart, &a.q, &a.qd, &a.t4, &a.bf16,
                        &a.mode, &a.K, &a.threads))
    return nullptr;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  error = hnlq::decode_direct(a.view(), a.attrs(), a.K, reinterpret_cast<float*>(w), a.threads);
  Py_END_ALLOW_THREADS
  return finish(error);
}

// decode_matmul(y, x, B, <codes>): y f32[B, N] = x f32[B, K] @ W_hat^T.
PyObject* DecodeMatmul(PyObject*, PyObject* args) {
  unsigned long long y, x;
  long long B;
  DirectArgs a{};
  if (!PyArg_ParseTuple(args, (std::string("KKL") + kCodesFormat).c_str(), &y, &x, &B,
                        &a.index, &a.u16, &a.N, &a.nb, &a.M, &a.tfield, &a.tb, &a.scale,
                        &a.codebook, &a.d, &a.pow2, &a.dither, &a.beta, &a.cart, &a.q, &a.qd,
                        &a.t4, &a.bf16, &a.mode, &a.K, &a.threads))
    return nullptr;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  error = hnlq::decode_matmul_direct(a.view(), a.attrs(), reinterpret_cast<const float*>(x), B,
                                     a.K, reinterpret_cast<float*>(y), a.threads);
  Py_END_ALLOW_THREADS
  return finish(error);
}

// rotate(y, x, R, n, s, B, k, m, inverse, threads): y f32[R, n] = x f32[R, n] R (or R^T).
PyObject* Rotate(PyObject*, PyObject* args) {
  unsigned long long y, x, s, B;
  long long R, n, k, m, threads;
  int inverse;
  if (!PyArg_ParseTuple(args, "KKLLKKLLpL", &y, &x, &R, &n, &s, &B, &k, &m, &inverse, &threads))
    return nullptr;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  error = hnlq::rotate_direct(reinterpret_cast<const float*>(x), R, n,
                              reinterpret_cast<const float*>(s),
                              reinterpret_cast<const float*>(B), k, m, inverse != 0,
                              reinterpret_cast<float*>(y), threads);
  Py_END_ALLOW_THREADS
  return finish(error);
}

// set_isa_limit(level) -> the previous limit: calls starting from now run at most Isa `level`
// (0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 VBMI; decode_rows.h), for tests and benchmarks.
PyObject* SetIsaLimit(PyObject*, PyObject* args) {
  int level;
  if (!PyArg_ParseTuple(args, "i", &level)) return nullptr;
  if (level < hnlq::kPortable || level > hnlq::kVbmi) {
    PyErr_SetString(PyExc_ValueError, "set_isa_limit: level must be 0, 1, 2 or 3");
    return nullptr;
  }
  return PyLong_FromLong(hnlq::isa_limit().exchange(level));
}

// active_isa() -> the Isa level a call starting now runs (the CPU's best, at most the limit).
PyObject* ActiveIsa(PyObject*, PyObject*) { return PyLong_FromLong(hnlq::active_isa()); }

PyMethodDef kMethods[] = {
    {"decode", Decode, METH_VARARGS, "decode(w, <codes>): the decode kernel on host buffers."},
    {"decode_matmul", DecodeMatmul, METH_VARARGS,
     "decode_matmul(y, x, B, <codes>): the product kernel on host buffers."},
    {"rotate", Rotate, METH_VARARGS,
     "rotate(y, x, R, n, s, B, k, m, inverse, threads): the rotation kernel on host buffers."},
    {"set_isa_limit", SetIsaLimit, METH_VARARGS,
     "set_isa_limit(level) -> previous: calls from now run at most this instruction set."},
    {"active_isa", ActiveIsa, METH_NOARGS,
     "active_isa() -> the instruction set level a call starting now runs (0 to 3)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu",
                       "Native CPU kernels of hnlq_jax (XLA FFI handlers and direct calls).", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__cpu(void) {
  PyObject* module = PyModule_Create(&kModule);
  if (!module) return nullptr;
  PyObject* handlers = PyDict_New();
  if (!handlers || PyModule_AddObject(module, "handlers", handlers) < 0) {
    Py_XDECREF(handlers);
    Py_DECREF(module);
    return nullptr;
  }
  for (const Target& t : kTargets) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(t.handler), nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(handlers, t.name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(module);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return module;
}
