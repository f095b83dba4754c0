// The planned due call, compiled (runtime/trace/native.py builds it on the target
// machine, against its torch): ``due`` is a native plan's whole due call, from the due
// test to the queued record, what api._fast does in Python for the direct launch; ``launch``
// is the launch alone, which api._fast calls where ``due`` hands a call back to it (another
// stream current, a launch hook, tracing not armed).  The tensor's layout is checked
// against the plan's through ATen's inline accessors (one object, no Python getters) and
// the kernel launched with the driver's cuLaunchKernel: what five torch getters, the
// launch's argument list and Triton's launcher cost in Python, cold, and what the
// interpreter's frame around them cost (docs/bench-notes/overhead.md, "The due trace() call").
//
// The GIL is held throughout and no Python code runs between a plan's parameter slots
// written and its launch, so the slots need no lock of their own.

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <ctime>
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
  c10::DeviceType device_type;
  c10::DeviceIndex device;
  bool aligned;
  int64_t nbytes = 0;  // what the kernel writes, and the ring slice it takes (ring.ALIGN): ``due`` claims it
  int64_t padded = 0;
};

const char* kPlan = "source_patch.native_launch.Plan";

void free_plan(PyObject* capsule) {
  delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kPlan));
}

int64_t as_int(PyObject* value) {
  return static_cast<int64_t>(PyLong_AsLongLong(value));
}

// plan(tensor, launch, function, (gx, gy, gz), block, shared, types, values[, nbytes, padded])
// -> capsule.  ``tensor``: one of the layout the kernel is for; ``launch``: cuLaunchKernel's
// address (tests: a stand-in's); ``types``: a code per parameter, 'p' (pointer), 'i' (32-bit
// int), 'l' (64-bit int); ``values``: the parameters after the input and the output
// (pointers as ints); ``nbytes``, ``padded``: the result's size and its ring slice's (for ``due``).
PyObject* plan(PyObject*, PyObject* args) {
  PyObject *tensor, *values;
  unsigned long long launch, function;
  unsigned block, shared;
  const char* types;
  auto p = std::make_unique<Plan>();
  long long nbytes = 0, padded = 0;
  if (!PyArg_ParseTuple(args, "OKK(III)IIsO!|LL", &tensor, &launch, &function, &p->grid[0], &p->grid[1], &p->grid[2],
                        &block, &shared, &types, &PyTuple_Type, &values, &nbytes, &padded)) {
    return nullptr;
  }
  if (launch == 0 || nbytes < 0 || padded < nbytes) {
    PyErr_SetString(PyExc_ValueError, "plan(): a launch function is needed, and padded >= nbytes >= 0");
    return nullptr;
  }
  p->nbytes = nbytes;
  p->padded = padded;
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
  p->device_type = t.device().type();
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
// with no CUDA header.  A plan for a CPU tensor (tests: a stand-in launch function)
// launches on a null stream.
std::optional<uintptr_t> default_stream(const Plan& p) {
  if (p.device_type != c10::DeviceType::CUDA) {
    return 0;
  }
  try {
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
  } catch (const std::exception&) {
    return std::nullopt;  // (c10's error: Python's checks say what is wrong)
  }
}

// The tensor's data address where ``object`` is a plain tensor of the plan's layout, else 0.
uintptr_t planned_input(const Plan& p, PyObject* object) {
  if (!THPVariable_CheckExact(object)) {
    return 0;  // not a plain tensor (a subclass may mean anything): the general path
  }
  const at::Tensor& t = THPVariable_Unpack(object);
  if (!t.defined() || t.layout() != c10::kStrided || t.device().type() != p.device_type || t.scalar_type() != p.dtype ||
      t.device().index() != p.device || t.sizes() != c10::IntArrayRef(p.sizes) || !t.is_contiguous() ||
      !t.has_storage()) {
    return 0;
  }
  uintptr_t input = reinterpret_cast<uintptr_t>(t.data_ptr());
  return input != 0 && ((input & 15) == 0) == p.aligned ? input : 0;
}

// The driver's status (0: launched).
int fire(Plan& p, uintptr_t input, uintptr_t output, uintptr_t stream) {
  p.slots[0] = input;
  p.slots[1] = output;
  return p.launch(p.function, p.grid[0], p.grid[1], p.grid[2], p.block, 1, 1, p.shared, reinterpret_cast<void*>(stream),
                  p.params.data(), nullptr);
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
  uintptr_t input = planned_input(*p, args[1]);
  if (input == 0) {
    return PyLong_FromLong(1);
  }
  uintptr_t output = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[2]));
  uintptr_t stream = 0;
  if (nargs == 4) {
    stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[3]));
  } else {
    std::optional<uintptr_t> current = default_stream(*p);
    if (!current) {
      return PyLong_FromLong(2);
    }
    stream = *current;
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  int status = fire(*p, input, output, stream);
  return PyLong_FromLong(status == 0 ? 0 : -status);
}

// ---- the whole due call (``due``): what it reads of the trace state, set by ``arm``.
// api's state is read from api's module dict at each call, the way api._fast reads its
// globals: reset, close and a forked child rebind parts of it.  The ring's head and tail
// are two int64 in memory the ring owns (ring.py: Ring.cursor), read and written here
// under api's lock, as api._fast does.

struct Lane {
  PyObject* api = nullptr;      // api's module dict
  PyObject* ambient = nullptr;  // runtime/core/tags.py's module dict (its _context)
  PyObject* ring = nullptr;     // the ring (kept alive: the cursor is its memory)
  PyObject* lock = nullptr;     // api's lock, and its bound ``locked`` (lock_held)
  PyObject* locked = nullptr;
  int64_t* cursor = nullptr;    // [head, tail]
  int64_t size = 0;
  uint64_t device_address = 0;  // where the device sees the ring
  Py_ssize_t batch = 64;        // api.BATCH
  double flush = 0.2;           // api.FLUSH_SECONDS
  double clock_offset = 0.0;    // api._clock_offset: the monotonic clock -> the epoch
};

Lane lane;  // one per process, as api's state is
bool armed = false;

struct Names {
  PyObject *step, *fast, *fast_ring, *hook_calls, *lock, *pending, *config, *queue, *counts, *dropped, *records,
      *tracer, *publisher, *seal, *durations, *failed, *context, *sub, *next_step, *every, *stream, *native, *acquire,
      *release, *locked;
};
Names names;

bool intern_names() {
  const char* text[] = {"_step", "_fast", "_fast_ring", "_hook_calls", "_lock", "_pending", "_config", "queue",
                        "_counts", "dropped", "_records", "_tracer", "_publisher", "_seal_and_wake", "_durations",
                        "_fast_failed", "_context", "sub", "next_step", "every", "stream", "native", "acquire",
                        "release", "locked"};
  static_assert(sizeof text / sizeof *text * sizeof(PyObject*) == sizeof(Names), "a name for every field");
  auto** slot = reinterpret_cast<PyObject**>(&names);
  for (size_t i = 0; i < sizeof text / sizeof *text; ++i) {
    slot[i] = PyUnicode_InternFromString(text[i]);
    if (slot[i] == nullptr) {
      return false;
    }
  }
  return true;
}

// arm(api_dict, tags_dict, ring, cursor_address, size, device_address, batch, flush, clock_offset):
// due calls claim slices of ``ring``; arm(api_dict, tags_dict, None): every due call is
// handed to api._fast.
PyObject* arm(PyObject*, PyObject* args) {
  PyObject *api, *ambient, *ring = Py_None;
  unsigned long long cursor = 0, device_address = 0;
  long long size = 0;
  Py_ssize_t batch = 64;
  double flush = 0.2, offset = 0.0;
  if (!PyArg_ParseTuple(args, "O!O!|OKLKndd", &PyDict_Type, &api, &PyDict_Type, &ambient, &ring, &cursor, &size,
                        &device_address, &batch, &flush, &offset)) {
    return nullptr;
  }
  if (ring != Py_None && (cursor == 0 || size <= 0 || batch <= 0)) {
    PyErr_SetString(PyExc_ValueError, "arm(): a ring needs its cursor's address, its size and a batch");
    return nullptr;
  }
  Py_INCREF(api);
  Py_INCREF(ambient);
  Py_XSETREF(lane.api, api);
  Py_XSETREF(lane.ambient, ambient);
  Py_CLEAR(lane.ring);
  armed = ring != Py_None;
  if (armed) {
    lane.ring = Py_NewRef(ring);
    lane.cursor = reinterpret_cast<int64_t*>(static_cast<uintptr_t>(cursor));
    lane.size = size;
    lane.device_address = device_address;
    lane.batch = batch;
    lane.flush = flush;
    lane.clock_offset = offset;
  }
  Py_RETURN_NONE;
}

double monotonic() {  // time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux)
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// api's global ``name`` (borrowed), or nullptr with an error set.
PyObject* global(PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(lane.api, name);
  if (value == nullptr && !PyErr_Occurred()) {
    PyErr_SetObject(PyExc_KeyError, name);
  }
  return value;
}

// A new reference to api._fast(plan, key, tensor, tags)'s answer: the call handed back.
PyObject* hand_back(PyObject* const* args) {
  if (lane.api == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "due(): api has not called arm() yet");
    return nullptr;
  }
  PyObject* fast = global(names.fast);
  return fast == nullptr ? nullptr : PyObject_Vectorcall(fast, args, 4, nullptr);
}

// Whether api's due test finds ``key`` not due at ``step``: -1 error, 0 due, 1 not due.
int not_due(PyObject* next_step, PyObject* key, long long step, long long every) {
  PyObject* following = PyDict_GetItemWithError(next_step, key);
  if (following == nullptr) {
    return PyErr_Occurred() ? -1 : 0;
  }
  long long f = PyLong_AsLongLong(following);
  if (f == -1 && PyErr_Occurred()) {
    return -1;
  }
  return f - every <= step && step < f;
}

// Whether a thread holds api's lock: 1 yes, 0 no, -1 error.  ``due`` claims its slice
// without taking the lock where nobody holds it.  That is safe because it holds the GIL
// and runs no Python code from this test to the ring's head written: every critical
// section of the lock is Python, which needs the GIL, and a thread that takes the lock
// meanwhile (waiting without the GIL) runs its section only after this call gives the
// GIL back.  Taking and giving back the lock by its methods cost ~2 µs of a cold call
// (acquire parses its arguments); ``locked``, bound once, is one call.
int lock_held() {
  PyObject* lock = global(names.lock);
  if (lock == nullptr) {
    return -1;
  }
  if (lock != lane.lock) {  // (api's lock is replaced only in a forked child)
    PyObject* locked = PyObject_GetAttr(lock, names.locked);
    if (locked == nullptr) {
      return -1;
    }
    Py_XSETREF(lane.locked, locked);
    Py_XSETREF(lane.lock, Py_NewRef(lock));
  }
  PyObject* held = PyObject_CallNoArgs(lane.locked);
  if (held == nullptr) {
    return -1;
  }
  int answer = held == Py_True;
  Py_DECREF(held);
  return answer;
}

// (nobody holds api's lock: lock_held) Claim the slice and launch: api._fast's part under
// its lock, with no Python code run and nothing the garbage collector counts allocated.
// 1: launched, ``offset`` and ``end`` set; 0: dropped and counted (the publisher, or the
// forwarder, is behind); -1: an error is set.
int claim_and_launch(Plan& p, uintptr_t input, uintptr_t stream, int64_t& offset, int64_t& end) {
  PyObject* pending = global(names.pending);
  PyObject* config = pending ? global(names.config) : nullptr;
  PyObject* limit = config && PyDict_Check(config) ? PyDict_GetItemWithError(config, names.queue) : nullptr;
  if (limit == nullptr) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_KeyError, "api._config has no queue limit");
    }
    return -1;
  }
  Py_ssize_t queued = PyObject_Length(pending);
  long long most = PyLong_AsLongLong(limit);
  if (queued < 0 || (most == -1 && PyErr_Occurred())) {
    return -1;
  }
  int64_t head = lane.cursor[0];
  offset = head % lane.size;
  if (offset + p.nbytes > lane.size) {  // a slice never wraps: skip to the ring's start (ring._take)
    head += lane.size - offset;
    offset = 0;
  }
  end = head + p.padded;
  if (queued >= most || end - lane.cursor[1] > lane.size) {
    PyObject* counts = global(names.counts);
    PyObject* dropped = counts ? PyObject_GetItem(counts, names.dropped) : nullptr;
    long long was = dropped ? PyLong_AsLongLong(dropped) : -1;
    Py_XDECREF(dropped);
    PyObject* more = was >= 0 ? PyLong_FromLongLong(was + 1) : nullptr;
    int status = more ? PyObject_SetItem(counts, names.dropped, more) : -1;
    Py_XDECREF(more);
    return status;
  }
  int status = fire(p, input, lane.device_address + static_cast<uint64_t>(offset), stream);
  if (status != 0) {
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel: CUDA error %d", status);
    return -1;
  }
  lane.cursor[0] = end;
  return 1;
}

// The tags a record keeps: the call's, over the ambient context's where there is one
// (copied now: published later, the microbatch will have moved on).  A new reference.
PyObject* with_context(PyObject* tags) {
  PyObject* context = PyDict_GetItemWithError(lane.ambient, names.context);
  if (context == nullptr) {
    return PyErr_Occurred() ? nullptr : Py_NewRef(tags);
  }
  if (!PyDict_Check(context) || PyDict_GET_SIZE(context) == 0) {
    return Py_NewRef(tags);
  }
  PyObject* merged = PyDict_Copy(context);
  if (merged != nullptr && PyDict_Update(merged, tags) < 0) {
    Py_CLEAR(merged);
  }
  return merged;
}

// (after claim_and_launch) Queue the record of the slice: api._fast's ``_records.append``,
// and where the batch is full or due out (or no publisher runs yet), _seal_and_wake under
// api's lock.  0: done; -1: an error is set.
int queue_record(PyObject* plan, PyObject* key, PyObject* call_tags, long long step, double stamp, int64_t offset,
                 int64_t end) {
  PyObject* tags = with_context(call_tags);
  PyObject* records = tags ? global(names.records) : nullptr;
  PyObject* stream_object = records ? PyObject_GetAttr(plan, names.stream) : nullptr;
  PyObject* record = stream_object ? Py_BuildValue("(OOOLdLLN)", plan, PyTuple_GET_ITEM(key, 0), tags, step, stamp,
                                                   static_cast<long long>(offset), static_cast<long long>(end),
                                                   stream_object)
                                   : nullptr;
  Py_XDECREF(tags);
  if (record == nullptr || !PyList_Check(records)) {
    Py_XDECREF(record);
    return -1;
  }
  int appended = PyList_Append(records, record);
  Py_DECREF(record);
  PyObject* ident = appended == 0 ? PyLong_FromUnsignedLong(PyThread_get_thread_ident()) : nullptr;
  if (ident == nullptr || PyDict_SetItem(lane.api, names.tracer, ident) < 0) {
    Py_XDECREF(ident);
    return -1;
  }
  Py_DECREF(ident);
  PyObject* publisher = global(names.publisher);
  if (publisher == nullptr) {
    return -1;
  }
  Py_ssize_t count = PyList_GET_SIZE(records);
  double first = count ? PyFloat_AsDouble(PyTuple_GET_ITEM(PyList_GET_ITEM(records, 0), 4)) : stamp;
  if (publisher != Py_None && count < lane.batch && stamp - first <= lane.flush) {
    return 0;
  }
  PyObject* seal = global(names.seal);
  PyObject* lock = seal ? global(names.lock) : nullptr;
  PyObject* taken = lock ? PyObject_CallMethodNoArgs(lock, names.acquire) : nullptr;
  if (taken == nullptr) {
    return -1;
  }
  Py_DECREF(taken);
  PyObject* done = PyObject_CallNoArgs(seal);
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);  // (the lock is given back whatever happened)
  PyObject* given = PyObject_CallMethodNoArgs(lock, names.release);
  if (given == nullptr) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
  } else {
    PyErr_Restore(type, value, trace);
  }
  int status = done != nullptr && given != nullptr ? 0 : -1;
  Py_XDECREF(done);
  Py_XDECREF(given);
  return status;
}

// due(plan, key, tensor, tags) -> True: done (or not due); else api._fast(plan, key,
// tensor, tags)'s answer, the call handed to it: api.trace calls this as a native plan's
// ``due``.  api._fast's steps, in order, for the one case it plans: tracing armed, no
// launch hook, the tensor of the plan's layout, the device's default stream current.
// Runtime failures are handed to api._fast_failed (counted, the plan set aside), never
// raised into the step.
PyObject* due(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_CheckExact(args[1]) || PyTuple_GET_SIZE(args[1]) < 1 || !PyDict_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "due(plan, key, tensor, tags): key a tuple, tags a dict");
    return nullptr;
  }
  double start = monotonic();
  PyObject *plan = args[0], *key = args[1], *tensor = args[2];
  if (!armed) {
    return hand_back(args);
  }
  PyObject* capsule = PyObject_GetAttr(plan, names.native);
  if (capsule == nullptr) {
    return nullptr;  // not a plan (a bug: raised)
  }
  auto* p = capsule == Py_None ? nullptr : static_cast<Plan*>(PyCapsule_GetPointer(capsule, kPlan));
  Py_DECREF(capsule);  // (the plan object keeps it)
  if (p == nullptr) {
    return PyErr_Occurred() ? nullptr : hand_back(args);  // a plan without a native launch
  }
  PyObject* sub = PyObject_GetAttr(plan, names.sub);
  PyObject* next_step = sub ? PyObject_GetAttr(sub, names.next_step) : nullptr;
  PyObject* every_object = next_step ? PyObject_GetAttr(sub, names.every) : nullptr;
  Py_XDECREF(sub);
  PyObject* step = every_object ? global(names.step) : nullptr;  // (borrowed: read at once)
  long long every = every_object ? PyLong_AsLongLong(every_object) : -1;
  Py_XDECREF(every_object);
  long long step_value = step ? PyLong_AsLongLong(step) : -1;
  int skip = PyErr_Occurred() ? -1 : not_due(next_step, key, step_value, every);
  if (skip != 0) {
    Py_XDECREF(next_step);
    if (skip < 0) {
      return nullptr;  // not a plan of this module, or api's state is not what it should be: a bug, raised
    }
    Py_RETURN_TRUE;  // not due
  }
  PyObject* fast_ring = global(names.fast_ring);
  PyObject* hooks = fast_ring ? global(names.hook_calls) : nullptr;
  bool hooked = hooks == nullptr || !PyTuple_Check(hooks) || PyTuple_GET_SIZE(hooks) != 2 ||
                PyObject_IsTrue(PyTuple_GET_ITEM(hooks, 0)) || PyObject_IsTrue(PyTuple_GET_ITEM(hooks, 1));
  uintptr_t input = 0;
  std::optional<uintptr_t> stream;
  if (fast_ring != lane.ring || hooked || (input = planned_input(*p, tensor)) == 0 || !(stream = default_stream(*p))) {
    Py_DECREF(next_step);
    PyErr_Clear();
    return hand_back(args);  // not armed for this ring, a launch hook, another layout or stream: api._fast decides
  }
  int status = lock_held();
  if (status > 0) {
    Py_DECREF(next_step);
    return hand_back(args);  // another thread is in api's lock: api._fast waits for it
  }
  if (status == 0) {
    int64_t offset = 0, end = 0;
    status = claim_and_launch(*p, input, *stream, offset, end);
    if (status > 0) {
      status = queue_record(plan, key, args[3], step_value, start + lane.clock_offset, offset, end);
    }
  }
  if (status < 0) {  // tracing must never break the step: api._fast_failed counts it and sets the plan aside
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    PyObject* failed = global(names.failed);
    PyObject* done = failed && value ? PyObject_CallFunctionObjArgs(failed, plan, key, value, nullptr) : nullptr;
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    if (done == nullptr) {
      Py_DECREF(next_step);
      return nullptr;
    }
    Py_DECREF(done);
  }
  PyObject* following = PyLong_FromLongLong(step_value + every);
  int noted = following ? PyDict_SetItem(next_step, key, following) : -1;  // (not before: see api._fast)
  Py_XDECREF(following);
  Py_DECREF(next_step);
  PyObject* durations = noted == 0 ? global(names.durations) : nullptr;
  PyObject* elapsed = durations ? PyFloat_FromDouble(monotonic() - start) : nullptr;
  int appended = elapsed ? PyList_Append(durations, elapsed) : -1;
  Py_XDECREF(elapsed);
  if (appended < 0) {
    return nullptr;
  }
  Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"plan", reinterpret_cast<PyCFunction>(plan), METH_VARARGS, "A launch plan for one kernel and tensor layout."},
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch)), METH_FASTCALL,
     "launch(plan, tensor, output[, stream]) -> 0 launched, 1 another layout, 2 not on the default stream, "
     "-N the driver's error N."},
    {"due", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(due)), METH_FASTCALL,
     "due(plan, key, tensor, tags) -> True done, else api._fast's answer (the call handed to it)."},
    {"arm", reinterpret_cast<PyCFunction>(arm), METH_VARARGS,
     "arm(api_dict, tags_dict, ring, cursor, size, device_address, batch, flush, clock_offset); ring None: disarmed."},
    {nullptr, nullptr, 0, nullptr}};

#define SP_CONCAT(a, b) a##b
#define SP_INIT(name) SP_CONCAT(PyInit_, name)

PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_launch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC SP_INIT(TORCH_EXTENSION_NAME)(void) {
  module.m_name = C10_STRINGIZE(TORCH_EXTENSION_NAME);
  return intern_names() ? PyModule_Create(&module) : nullptr;
}
