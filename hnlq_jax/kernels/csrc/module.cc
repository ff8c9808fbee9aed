// hnlq_jax.kernels._cpu: the native CPU kernels' XLA FFI handlers as PyCapsules, registered
// with jax.ffi.register_ffi_target by hnlq_jax.kernels.cpu. One kernel per source file; this
// file only lists them.

#include <Python.h>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HnlqDecode(XLA_FFI_CallFrame* frame);
extern "C" XLA_FFI_Error* HnlqDecodeMatmul(XLA_FFI_CallFrame* frame);

namespace {

struct Target {
  const char* name;
  XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*);
};

constexpr Target kTargets[] = {
    {"hnlq_decode", HnlqDecode},
    {"hnlq_decode_matmul", HnlqDecodeMatmul},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu",
                       "Native CPU kernels of hnlq_jax (XLA FFI handlers).", -1, nullptr};

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
