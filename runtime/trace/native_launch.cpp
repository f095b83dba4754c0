// The planned due call's launch, compiled (runtime/trace/native.py builds it on the
// target machine, against its torch).  api._fast hands it the tensor, the stream and
// the ring slice; it checks the tensor's layout against the plan's through ATen's
// inline accessors (one object, no Python getters) and launches the kernel with the
// driver's cuLaunchKernel: what five torch getters, the launch's argument list and
// Triton's launcher (argument parsing, then the launch) cost in Python, cold
// (docs/bench-notes/overhead.md, "The due trace() call").
//
// The GIL is held throughout: calls are serialised by it and by api's lock, so a
// plan's parameter slots need no lock of their own.

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

namespace {

// cuLaunchKernel's signature, declared here so that no CUDA header is needed: the
// address comes from the process's libcuda (native.py: ctypes), which Triton and torch
// have loaded already.
using Launch = int (*)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned shared, void* stream, void** params, void** extra);

struct Plan {
  Launch launch;
  void* function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<uint64_t> slots;  // one 8-byte slot per kernel parameter; 0 and 1: input, output
  std::vector<void*> params;    // cuLaunchKernel's pointers to the slots
  std::vector<int64_t> sizes;   // the layout the kernel was compiled and its grid computed for
  c10::ScalarType dtype;
  c10::DeviceIndex device;
  bool aligned;
};

const char* kPlan = "source_patch.native_launch.Plan";

void free_plan(PyObject* capsule) {
  delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kPlan));
}

int64_t as_int(PyObject* value) {
  return static_cast<int64_t>(PyLong_AsLongLong(value));
}

// plan(tensor, launch, function, (gx, gy, gz), block, shared, types, values) -> capsule.
// ``tensor``: one of the layout the kernel is for; ``launch``: cuLaunchKernel's address;
// ``types``: a code per parameter, 'p' (pointer), 'i' (32-bit int), 'l' (64-bit int);
// ``values``: the parameters after the input and the output (pointers as ints).
PyObject* plan(PyObject*, PyObject* args) {
  PyObject *tensor, *values;
  unsigned long long launch, function;
  unsigned block, shared;
  const char* types;
  auto p = std::make_unique<Plan>();
  if (!PyArg_ParseTuple(args, "OKK(III)IIsO!", &tensor, &launch, &function, &p->grid[0], &p->grid[1], &p->grid[2],
                        &block, &shared, &types, &PyTuple_Type, &values)) {
    return nullptr;
  }
  if (!THPVariable_CheckExact(tensor)) {
    PyErr_SetString(PyExc_TypeError, "plan(): a plain torch.Tensor is needed");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(tensor);
  size_t count = std::strlen(types);
  if (count < 2 || types[0] != 'p' || types[1] != 'p' || static_cast<size_t>(PyTuple_GET_SIZE(values)) != count - 2) {
    PyErr_SetString(PyExc_ValueError, "plan(): types must start with the input and output pointers, "
                                      "and values give every other parameter");
    return nullptr;
  }
  p->launch = reinterpret_cast<Launch>(static_cast<uintptr_t>(launch));
  p->function = reinterpret_cast<void*>(static_cast<uintptr_t>(function));
  p->block = block;
  p->shared = shared;
  p->slots.assign(count, 0);
  for (size_t i = 2; i < count; ++i) {
    PyObject* value = PyTuple_GET_ITEM(values, i - 2);
    int64_t v = value == Py_None ? 0 : as_int(value);
    if (PyErr_Occurred()) {
      return nullptr;
    }
    if (types[i] == 'i') {
      int32_t narrow = static_cast<int32_t>(v);
      std::memcpy(&p->slots[i], &narrow, sizeof narrow);  // the driver reads 4 bytes of this slot
    } else if (types[i] == 'l' || types[i] == 'p') {
      p->slots[i] = static_cast<uint64_t>(v);
    } else {
      PyErr_Format(PyExc_ValueError, "plan(): unknown parameter type %c", types[i]);
      return nullptr;
    }
  }
  for (auto& slot : p->slots) {
    p->params.push_back(&slot);
  }
  p->sizes.assign(t.sizes().begin(), t.sizes().end());
  p->dtype = t.scalar_type();
  p->device = t.device().index();
  p->aligned = (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
  PyObject* capsule = PyCapsule_New(p.get(), kPlan, free_plan);
  if (capsule != nullptr) {
    p.release();  // the capsule owns it now
  }
  return capsule;
}

// The current stream's handle where it is the plan's device's default stream (never
// captured by a CUDA graph), else nullopt: Python's checks then decide, and pass the
// stream.  Through c10's device guard, the way torch.cuda.current_stream() reads it,
// with no CUDA header.
std::optional<uintptr_t> default_stream(const Plan& p) {
  const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Device device = guard->getDevice();
  if (device.index() != p.device) {
    return std::nullopt;
  }
  c10::Stream stream = guard->getStream(device);
  if (stream.id() != 0) {
    return std::nullopt;
  }
  return reinterpret_cast<uintptr_t>(stream.native_handle());
}

// launch(plan, tensor, output[, stream]) -> 0: launched; 1: the tensor is not of the
// plan's layout (nothing launched: plan again); 2: no stream given and the current one
// is not the plan's device's default stream (nothing launched); -N: the driver's error N.
PyObject* launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 && nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "launch(plan, tensor, output[, stream])");
    return nullptr;
  }
  auto* p = static_cast<Plan*>(PyCapsule_GetPointer(args[0], kPlan));
  if (p == nullptr) {
    return nullptr;
  }
  if (!THPVariable_CheckExact(args[1])) {
    return PyLong_FromLong(1);  // not a plain tensor (a subclass may mean anything): the general path
  }
  const at::Tensor& t = THPVariable_Unpack(args[1]);
  if (!t.defined() || t.layout() != c10::kStrided || !t.is_cuda() || t.scalar_type() != p->dtype ||
      t.device().index() != p->device || t.sizes() != c10::IntArrayRef(p->sizes) || !t.is_contiguous() ||
      !t.has_storage()) {
    return PyLong_FromLong(1);
  }
  uintptr_t input = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (((input & 15) == 0) != p->aligned) {
    return PyLong_FromLong(1);
  }
  uintptr_t output = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[2]));
  uintptr_t stream = 0;
  if (nargs == 4) {
    stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[3]));
  } else {
    std::optional<uintptr_t> current;
    try {
      current = default_stream(*p);
    } catch (const std::exception&) {
      current = std::nullopt;  // (c10's error: Python's checks say what is wrong)
    }
    if (!current) {
      return PyLong_FromLong(2);
    }
    stream = *current;
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  p->slots[0] = input;
  p->slots[1] = output;
  int status = p->launch(p->function, p->grid[0], p->grid[1], p->grid[2], p->block, 1, 1, p->shared,
                         reinterpret_cast<void*>(stream), p->params.data(), nullptr);
  return PyLong_FromLong(status == 0 ? 0 : -status);
}

PyMethodDef methods[] = {
    {"plan", reinterpret_cast<PyCFunction>(plan), METH_VARARGS, "A launch plan for one kernel and tensor layout."},
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch)), METH_FASTCALL,
     "launch(plan, tensor, output[, stream]) -> 0 launched, 1 another layout, 2 not on the default stream, "
     "-N the driver's error N."},
    {nullptr, nullptr, 0, nullptr}};

#define SP_CONCAT(a, b) a##b
#define SP_INIT(name) SP_CONCAT(PyInit_, name)

PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_launch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC SP_INIT(TORCH_EXTENSION_NAME)(void) {
  module.m_name = C10_STRINGIZE(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module);
}
