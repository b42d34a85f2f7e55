/* perfmon's hook hot path in C: the same events as the Python hooks in hooks.py, without a Python frame.
 *
 * Optional: built by `pip install` where a C compiler exists; hooks.py falls back to its pure-Python
 * hooks otherwise (or with PERFMON_NO_ACCEL=1). Each object mirrors one Python hook line for line: its
 * common case (host timing only, no step decision to make) is done here; every other case calls the same
 * Python method the Python hook calls (``Instrumentation.begin``/``end``), so the step logic lives in one
 * place. Nothing here raises into training: a failure of the bookkeeping goes to ``inst._on_error``.
 *
 * Event tuples are ``(code, perf_counter(), arg, None)``, the clock being ``time.perf_counter`` itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include "structmember.h"

/* event codes: perfmon.agent.steps */
#define BEGIN 0
#define END 1
#define END_BOUNDARY 6

/* what a Timed wraps */
#define KIND_DATA 0
#define KIND_BACKWARD 1

static PyObject *s_fast, *s_depth, *s_pending, *s_optimizers_seen, *s_in_data, *s_begin, *s_end, *s_on_error,
    *s_hooks, *s_single, *s_explicit, *s_discovering, *s_finish_discovery, *s_boundary, *s_note_optimizer,
    *s_dim, *s_shape, *s_values, *s_data, *s_optimizer, *s_key, *s_forward, *s_in_root,
    *s_commands, *s_boundaries, *s_window, *s_flops_mode, *s_memory, *s_next_every, *s_next_time, *s_after_count;
static PyObject *kw_key;  /* ("key",) */
static PyObject *code_begin, *code_end, *code_end_boundary;

/* -- small helpers ------------------------------------------------------------------------------------ */

static long get_long(PyObject *obj, PyObject *name, int *err) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) { *err = 1; return 0; }
    long r = PyLong_AsLong(v);
    Py_DECREF(v);
    if (r == -1 && PyErr_Occurred()) *err = 1;
    return r;
}

static int set_long(PyObject *obj, PyObject *name, long value) {
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

static int get_truth(PyObject *obj, PyObject *name) {  /* -1 on error */
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* fast((code, perf_counter(), arg, None)) */
static int append_event(PyObject *fast, PyObject *clock, PyObject *code, PyObject *arg) {
    PyObject *t = PyObject_CallNoArgs(clock);
    if (t == NULL) return -1;
    PyObject *ev = PyTuple_Pack(4, code, t, arg, Py_None);
    Py_DECREF(t);
    if (ev == NULL) return -1;
    PyObject *r = PyObject_CallOneArg(fast, ev);
    Py_DECREF(ev);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* An error of perfmon's own bookkeeping: to inst._on_error("hooks", exc), never into training. */
static void report(PyObject *inst) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyObject *r = PyObject_CallMethodObjArgs(inst, s_on_error, s_hooks, value, NULL);
        Py_XDECREF(r);
    }
    PyErr_Clear();
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* inst.begin(phase) or inst.begin(phase, key=key): the Python hooks' slow path, which catches its own errors */
static void call_slow(PyObject *inst, PyObject *method, PyObject *phase, PyObject *arg, PyObject *key) {
    PyObject *r;
    if (key != NULL) {  /* inst.method(phase, arg, key=key) */
        PyObject *call[4] = {inst, phase, arg != NULL ? arg : Py_None, key};
        r = PyObject_VectorcallMethod(method, call, 3, kw_key);
    } else if (arg != NULL) {
        r = PyObject_CallMethodObjArgs(inst, method, phase, arg, NULL);
    } else {
        r = PyObject_CallMethodObjArgs(inst, method, phase, NULL);
    }
    if (r == NULL) report(inst);
    else Py_DECREF(r);
}

/* hooks.batch_size: leading dimension of the first tensor found (a few containers deep); NULL with no error
 * for None. A failure of an odd batch type is None, as in Python (only non-Exception errors propagate). */
static PyObject *batch_size(PyObject *batch, PyObject *tensor_type) {
    Py_INCREF(batch);
    for (int depth = 0; depth < 4; depth++) {
        int is_tensor = PyObject_IsInstance(batch, tensor_type);
        if (is_tensor < 0) goto fail;
        if (is_tensor) {
            PyObject *dim = PyObject_CallMethodNoArgs(batch, s_dim);
            if (dim == NULL) goto fail;
            int nonzero = PyObject_IsTrue(dim);
            Py_DECREF(dim);
            if (nonzero < 0) goto fail;
            if (!nonzero) { Py_DECREF(batch); return NULL; }
            PyObject *shape = PyObject_GetAttr(batch, s_shape);
            if (shape == NULL) goto fail;
            PyObject *first = PySequence_GetItem(shape, 0);
            Py_DECREF(shape);
            if (first == NULL) goto fail;
            PyObject *n = PyNumber_Long(first);
            Py_DECREF(first);
            if (n == NULL) goto fail;
            Py_DECREF(batch);
            return n;
        }
        PyObject *next = NULL;
        if (PyList_Check(batch) || PyTuple_Check(batch)) {
            Py_ssize_t size = PySequence_Size(batch);
            if (size < 0) goto fail;
            if (size == 0) break;
            next = PySequence_GetItem(batch, 0);
        } else if (PyDict_Check(batch)) {
            Py_ssize_t size = PyObject_Size(batch);
            if (size < 0) goto fail;
            if (size == 0) break;
            PyObject *values = PyObject_CallMethodNoArgs(batch, s_values);
            if (values == NULL) goto fail;
            PyObject *it = PyObject_GetIter(values);
            Py_DECREF(values);
            if (it == NULL) goto fail;
            next = PyIter_Next(it);
            Py_DECREF(it);
            if (next == NULL && !PyErr_Occurred()) PyErr_SetNone(PyExc_StopIteration);
        } else {
            break;
        }
        if (next == NULL) goto fail;
        Py_DECREF(batch);
        batch = next;
    }
    Py_DECREF(batch);
    return NULL;
fail:
    Py_DECREF(batch);
    if (PyErr_ExceptionMatches(PyExc_Exception)) PyErr_Clear();
    return NULL;
}


/* The step ended: the commands' boundary. With the agent's Commands at hand, count the boundary and look at what
 * could be due here (the common case: nothing, and no Python call); else Instrumentation._boundary(). */
static void step_ended(PyObject *inst) {
    PyObject *commands = PyObject_GetAttr(inst, s_commands);
    if (commands == NULL) { report(inst); return; }
    PyObject *r = NULL;
    if (commands == Py_None) {
        r = PyObject_CallMethodNoArgs(inst, s_boundary);
    } else {
        int err = 0;
        long n = get_long(commands, s_boundaries, &err);
        if (err || set_long(commands, s_boundaries, n + 1) < 0) { report(inst); Py_DECREF(commands); return; }
        int idle = get_truth(commands, s_pending);  /* then each of these must be None */
        if (idle >= 0) idle = !idle;
        PyObject *const names[] = {s_window, s_flops_mode, s_memory, s_next_every, s_next_time};
        for (size_t k = 0; idle > 0 && k < sizeof(names) / sizeof(names[0]); k++) {
            PyObject *v = PyObject_GetAttr(commands, names[k]);
            if (v == NULL) idle = -1;
            else { idle = v == Py_None; Py_DECREF(v); }
        }
        if (idle < 0) { report(inst); Py_DECREF(commands); return; }
        r = idle ? Py_NewRef(Py_None) : PyObject_CallMethodNoArgs(commands, s_after_count);
    }
    if (r == NULL) report(inst);
    Py_XDECREF(r);
    Py_DECREF(commands);
}

/* -- Timed: a wrapped function or method (DataLoader fetch, torch.autograd.backward) ------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig, *inst, *bounds, *phase, *clock, *tensor_type, *dict;
    int kind;
} Timed;

static PyObject *Timed_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Timed *self = (Timed *)op;
    PyObject *inst = self->inst, *bounds = self->bounds;
    int data = self->kind == KIND_DATA;
    int err = 0;

    /* begin: the common case inline, else Instrumentation.begin */
    PyObject *fast = PyObject_GetAttr(inst, s_fast);
    if (fast == NULL) { report(inst); fast = Py_NewRef(Py_None); }
    int inline_begin = 0;
    if (fast != Py_None) {
        long depth = get_long(bounds, s_depth, &err);
        int pending = err ? -1 : get_truth(bounds, s_pending);
        if (err || pending < 0) report(inst);
        else if (depth || !pending) {
            inline_begin = 1;
            if (set_long(bounds, s_depth, depth + 1) < 0
                || append_event(fast, self->clock, code_begin, self->phase) < 0) report(inst);
        }
    }
    Py_DECREF(fast);
    if (!inline_begin) call_slow(inst, s_begin, self->phase, NULL, NULL);
    if (data) {
        err = 0;
        long in_data = get_long(inst, s_in_data, &err);
        if (err || set_long(inst, s_in_data, in_data + 1) < 0) report(inst);
    }

    PyObject *result = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);

    /* end, whatever the call did (its exception is kept and re-raised) */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *end_arg = NULL;
    if (data) {
        err = 0;
        long in_data = get_long(inst, s_in_data, &err);
        if (err || set_long(inst, s_in_data, in_data - 1) < 0) report(inst);
        PyObject *n = NULL;
        if (result != NULL) {
            n = batch_size(result, self->tensor_type);
            if (n == NULL && PyErr_Occurred()) {  /* a KeyboardInterrupt while sizing: it goes up, as in Python */
                Py_CLEAR(result);
                Py_XDECREF(exc_type); Py_XDECREF(exc_value); Py_XDECREF(exc_tb);
                PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
            }
        }
        end_arg = PyTuple_Pack(2, s_data, n != NULL ? n : Py_None);
        Py_XDECREF(n);
        if (end_arg == NULL) { report(inst); end_arg = Py_NewRef(Py_None); }
    }
    fast = PyObject_GetAttr(inst, s_fast);
    if (fast == NULL) { report(inst); fast = Py_NewRef(Py_None); }
    int inline_end = 0;
    if (fast != Py_None) {
        err = 0;
        long depth = get_long(bounds, s_depth, &err);
        if (err) report(inst);
        else if (data) inline_end = depth != 0;  /* a fetch ends no step while a phase is open */
        else if (depth > 1) inline_end = 1;  /* a nested backward */
        else if (depth == 1) {  /* a backward that cannot end a step: an optimizer exists */
            int seen = get_truth(bounds, s_optimizers_seen);
            if (seen < 0) report(inst);
            else inline_end = seen;
        }
        if (inline_end && (set_long(bounds, s_depth, depth - 1) < 0
                           || append_event(fast, self->clock, code_end, data ? end_arg : self->phase) < 0))
            report(inst);
    }
    Py_DECREF(fast);
    if (!inline_end) call_slow(inst, s_end, self->phase, data ? end_arg : NULL, NULL);
    Py_XDECREF(end_arg);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return result;
}

static PyObject *Timed_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *orig, *inst, *bounds, *phase, *clock, *tensor_type;
    int kind;
    static char *names[] = {"orig", "inst", "bounds", "phase", "kind", "clock", "tensor_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOiOO", names, &orig, &inst, &bounds, &phase, &kind,
                                     &clock, &tensor_type))
        return NULL;
    if (kind != KIND_DATA && kind != KIND_BACKWARD) {
        PyErr_SetString(PyExc_ValueError, "kind must be DATA or BACKWARD");
        return NULL;
    }
    Timed *self = (Timed *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = Timed_vectorcall;
    self->orig = Py_NewRef(orig);
    self->inst = Py_NewRef(inst);
    self->bounds = Py_NewRef(bounds);
    self->phase = Py_NewRef(phase);
    self->clock = Py_NewRef(clock);
    self->tensor_type = Py_NewRef(tensor_type);
    self->kind = kind;
    return (PyObject *)self;
}

static int Timed_traverse(Timed *self, visitproc visit, void *arg) {
    Py_VISIT(self->orig); Py_VISIT(self->inst); Py_VISIT(self->bounds); Py_VISIT(self->phase);
    Py_VISIT(self->clock); Py_VISIT(self->tensor_type); Py_VISIT(self->dict);
    return 0;
}

static int Timed_clear(Timed *self) {
    Py_CLEAR(self->orig); Py_CLEAR(self->inst); Py_CLEAR(self->bounds); Py_CLEAR(self->phase);
    Py_CLEAR(self->clock); Py_CLEAR(self->tensor_type); Py_CLEAR(self->dict);
    return 0;
}

static void Timed_dealloc(Timed *self) {
    PyObject_GC_UnTrack(self);
    Timed_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* a method when set on a class (DataLoader iterators' __next__), a function when set on a module */
static PyObject *Timed_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyMemberDef Timed_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Timed, dict), READONLY},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Timed, vectorcall), READONLY},
    {NULL},
};

static PyGetSetDef Timed_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict},
    {NULL},
};

static PyTypeObject TimedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.Timed",
    .tp_doc = "A function or method timed as one phase (the C twin of a Python hook in hooks.py).",
    .tp_basicsize = sizeof(Timed),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = Timed_new,
    .tp_traverse = (traverseproc)Timed_traverse,
    .tp_clear = (inquiry)Timed_clear,
    .tp_dealloc = (destructor)Timed_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Timed, vectorcall),
    .tp_descr_get = Timed_get,
    .tp_dictoffset = offsetof(Timed, dict),
    .tp_members = Timed_members,
    .tp_getset = Timed_getset,
};

/* -- the optimizer step's pre and post hooks -------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inst, *bounds, *known, *clock;
    int post;
} OptimizerHook;

static PyObject *OptimizerHook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    OptimizerHook *self = (OptimizerHook *)op;
    PyObject *inst = self->inst, *bounds = self->bounds;
    if (PyVectorcall_NARGS(nargsf) < 1) {
        PyErr_SetString(PyExc_TypeError, "an optimizer step hook takes (optimizer, args, kwargs)");
        return NULL;
    }
    PyObject *opt = args[0];
    PyObject *key = PyLong_FromVoidPtr(opt);  /* id(opt) */
    if (key == NULL) { report(inst); Py_RETURN_NONE; }
    PyObject *fast = PyObject_GetAttr(inst, s_fast);
    if (fast == NULL) { report(inst); fast = Py_NewRef(Py_None); }
    int err = 0;
    if (!self->post) {
        int known = PySet_Contains(self->known, key);
        if (known < 0) report(inst);
        else if (!known) {
            PyObject *r = PyObject_CallMethodOneArg(inst, s_note_optimizer, opt);
            if (r == NULL) report(inst);
            else Py_DECREF(r);
        }
        int done = 0;
        if (fast != Py_None) {
            long depth = get_long(bounds, s_depth, &err);
            int pending = err ? -1 : get_truth(bounds, s_pending);
            if (err || pending < 0) report(inst);
            else if (depth || !pending) {
                done = 1;
                if (set_long(bounds, s_depth, depth + 1) < 0
                    || append_event(fast, self->clock, code_begin, s_optimizer) < 0) report(inst);
            }
        }
        if (!done) call_slow(inst, s_begin, s_optimizer, Py_None, key);
    } else {
        /* the loop's one optimizer, at top level: its step ends the training step (Boundaries.end's fast case) */
        int done = 0;
        if (fast != Py_None) {
            PyObject *single = PyObject_GetAttr(bounds, s_single);
            int same = single == NULL ? -1 : PyObject_RichCompareBool(key, single, Py_EQ);
            Py_XDECREF(single);
            long depth = same > 0 ? get_long(bounds, s_depth, &err) : 0;
            int explicit_ = (same > 0 && !err && depth == 1) ? get_truth(bounds, s_explicit) : 1;
            if (same < 0 || err || explicit_ < 0) report(inst);
            else if (same && depth == 1 && !explicit_) {
                done = 1;
                PyObject *arg = PyTuple_Pack(2, s_optimizer, key);
                if (arg == NULL || set_long(bounds, s_depth, 0) < 0
                    || append_event(fast, self->clock, code_end_boundary, arg) < 0) report(inst);
                Py_XDECREF(arg);
                int discovering = get_truth(inst, s_discovering);
                PyObject *r = NULL;
                if (discovering < 0) report(inst);
                else if (discovering) {
                    r = PyObject_CallMethodNoArgs(inst, s_finish_discovery);
                    if (r == NULL) report(inst);
                    Py_XDECREF(r);
                }
                step_ended(inst);
            }
        }
        if (!done) {
            PyObject *arg = PyTuple_Pack(2, s_optimizer, key);
            if (arg == NULL) report(inst);
            else {
                call_slow(inst, s_end, s_optimizer, arg, key);
                Py_DECREF(arg);
            }
        }
    }
    Py_DECREF(fast);
    Py_DECREF(key);
    Py_RETURN_NONE;
}

static PyObject *OptimizerHook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *inst, *bounds, *known, *clock;
    int post;
    static char *names[] = {"inst", "bounds", "known", "clock", "post", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!Op", names, &inst, &bounds, &PySet_Type, &known, &clock,
                                     &post))
        return NULL;
    OptimizerHook *self = (OptimizerHook *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = OptimizerHook_vectorcall;
    self->inst = Py_NewRef(inst);
    self->bounds = Py_NewRef(bounds);
    self->known = Py_NewRef(known);
    self->clock = Py_NewRef(clock);
    self->post = post;
    return (PyObject *)self;
}

static int OptimizerHook_traverse(OptimizerHook *self, visitproc visit, void *arg) {
    Py_VISIT(self->inst); Py_VISIT(self->bounds); Py_VISIT(self->known); Py_VISIT(self->clock);
    return 0;
}

static int OptimizerHook_clear(OptimizerHook *self) {
    Py_CLEAR(self->inst); Py_CLEAR(self->bounds); Py_CLEAR(self->known); Py_CLEAR(self->clock);
    return 0;
}

static void OptimizerHook_dealloc(OptimizerHook *self) {
    PyObject_GC_UnTrack(self);
    OptimizerHook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject OptimizerHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.OptimizerHook",
    .tp_doc = "The optimizer step's pre (post=False) or post hook (the C twin of hooks.py's).",
    .tp_basicsize = sizeof(OptimizerHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = OptimizerHook_new,
    .tp_traverse = (traverseproc)OptimizerHook_traverse,
    .tp_clear = (inquiry)OptimizerHook_clear,
    .tp_dealloc = (destructor)OptimizerHook_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(OptimizerHook, vectorcall),
};


/* -- Forward: the body of a root model's __call__ wrapper ------------------------------------------------
 * The wrapper itself stays a Python function (torch.compile inlines a module's __call__, which must be Python
 * code); it checks torch.compiler.is_compiling() and hands the rest to this: forward(orig, mod, args, kwargs). */

#define GRAD 0
#define NOGRAD 1
#define COPY 2

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inst, *bounds, *roots, *clock, *grad_enabled;
} Forward;


/* ref() is obj, for a weak reference ref */
static int weakref_is(PyObject *ref, PyObject *obj) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target = NULL;
    if (PyWeakref_GetRef(ref, &target) < 0) { PyErr_Clear(); return 0; }
    int same = target == obj;
    Py_XDECREF(target);
    return same;
#else
    return PyWeakref_GetObject(ref) == obj;
#endif
}

static PyObject *call_orig(PyObject *orig, PyObject *mod, PyObject *args, PyObject *kwargs) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *full = PyTuple_New(n + 1);
    if (full == NULL) return NULL;
    PyTuple_SET_ITEM(full, 0, Py_NewRef(mod));
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *r = PyObject_Call(orig, full, kwargs != Py_None ? kwargs : NULL);
    Py_DECREF(full);
    return r;
}

static PyObject *Forward_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Forward *self = (Forward *)op;
    PyObject *inst = self->inst, *bounds = self->bounds;
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL || !PyTuple_Check(args[2])
        || (args[3] != Py_None && !PyDict_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError, "forward(orig, module, args: tuple, kwargs: dict | None)");
        return NULL;
    }
    PyObject *orig = args[0], *mod = args[1];
    int err = 0;
    long in_root = get_long(inst, s_in_root, &err);
    long in_data = err ? 0 : get_long(inst, s_in_data, &err);
    if (err) { report(inst); return call_orig(orig, mod, args[2], args[3]); }
    if (in_root || in_data) return call_orig(orig, mod, args[2], args[3]);

    /* begin */
    PyObject *begin_arg = NULL, *kind_obj = NULL;
    PyObject *key = PyLong_FromVoidPtr(mod);
    PyObject *grad = key == NULL ? NULL : PyObject_CallNoArgs(self->grad_enabled);
    int is_grad = grad == NULL ? -1 : PyObject_IsTrue(grad);
    Py_XDECREF(grad);
    long kind = GRAD;
    if (is_grad == 0) {  /* another instance of the model's class: a copy (EMA) or a sibling */
        PyObject *ref = PyDict_GetItemWithError(self->roots, key);
        if (ref == NULL && PyErr_Occurred()) is_grad = -1;
        kind = ref != NULL && PyWeakref_Check(ref) && weakref_is(ref, mod) ? NOGRAD : COPY;
    }
    if (is_grad >= 0 && (kind_obj = PyLong_FromLong(kind)) != NULL)
        begin_arg = PyTuple_Pack(3, s_forward, key, kind_obj);
    if (begin_arg == NULL) {  /* perfmon's own failure: the call goes on untimed */
        report(inst);
        Py_XDECREF(key); Py_XDECREF(kind_obj);
        return call_orig(orig, mod, args[2], args[3]);
    }
    PyObject *fast = PyObject_GetAttr(inst, s_fast);
    if (fast == NULL) { report(inst); fast = Py_NewRef(Py_None); }
    int inline_begin = 0;
    if (fast != Py_None) {
        long depth = get_long(bounds, s_depth, &err);
        int pending = err ? -1 : get_truth(bounds, s_pending);
        if (err || pending < 0) report(inst);
        else if (depth || !pending) {
            inline_begin = 1;
            if (set_long(bounds, s_depth, depth + 1) < 0
                || append_event(fast, self->clock, code_begin, begin_arg) < 0) report(inst);
        }
    }
    Py_DECREF(fast);
    if (!inline_begin) call_slow(inst, s_begin, s_forward, begin_arg, kind_obj);
    Py_DECREF(begin_arg); Py_DECREF(kind_obj); Py_DECREF(key);
    err = 0;
    in_root = get_long(inst, s_in_root, &err);
    if (err || set_long(inst, s_in_root, in_root + 1) < 0) report(inst);

    PyObject *result = call_orig(orig, mod, args[2], args[3]);

    /* end, whatever the call did */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    err = 0;
    in_root = get_long(inst, s_in_root, &err);
    if (err || set_long(inst, s_in_root, in_root - 1) < 0) report(inst);
    fast = PyObject_GetAttr(inst, s_fast);
    if (fast == NULL) { report(inst); fast = Py_NewRef(Py_None); }
    int inline_end = 0;
    if (fast != Py_None) {
        err = 0;
        long depth = get_long(bounds, s_depth, &err);
        if (err) report(inst);
        else if (depth) {  /* a forward ends no step while a phase is open */
            inline_end = 1;
            if (set_long(bounds, s_depth, depth - 1) < 0
                || append_event(fast, self->clock, code_end, s_forward) < 0) report(inst);
        }
    }
    Py_DECREF(fast);
    if (!inline_end) call_slow(inst, s_end, s_forward, NULL, NULL);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return result;
}

static PyObject *Forward_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *inst, *bounds, *roots, *clock, *grad_enabled;
    static char *names[] = {"inst", "bounds", "roots", "clock", "grad_enabled", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!OO", names, &inst, &bounds, &PyDict_Type, &roots, &clock,
                                     &grad_enabled))
        return NULL;
    Forward *self = (Forward *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = Forward_vectorcall;
    self->inst = Py_NewRef(inst);
    self->bounds = Py_NewRef(bounds);
    self->roots = Py_NewRef(roots);
    self->clock = Py_NewRef(clock);
    self->grad_enabled = Py_NewRef(grad_enabled);
    return (PyObject *)self;
}

static int Forward_traverse(Forward *self, visitproc visit, void *arg) {
    Py_VISIT(self->inst); Py_VISIT(self->bounds); Py_VISIT(self->roots); Py_VISIT(self->clock);
    Py_VISIT(self->grad_enabled);
    return 0;
}

static int Forward_clear(Forward *self) {
    Py_CLEAR(self->inst); Py_CLEAR(self->bounds); Py_CLEAR(self->roots); Py_CLEAR(self->clock);
    Py_CLEAR(self->grad_enabled);
    return 0;
}

static void Forward_dealloc(Forward *self) {
    PyObject_GC_UnTrack(self);
    Forward_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ForwardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.Forward",
    .tp_doc = "forward(orig, module, args, kwargs): a root model's call timed as the forward phase.",
    .tp_basicsize = sizeof(Forward),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = Forward_new,
    .tp_traverse = (traverseproc)Forward_traverse,
    .tp_clear = (inquiry)Forward_clear,
    .tp_dealloc = (destructor)Forward_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Forward, vectorcall),
};

/* -- module --------------------------------------------------------------------------------------- */

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "perfmon.agent._hot",
    "perfmon's hook hot path in C (optional; hooks.py has the same hooks in Python).", -1, NULL,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__hot(void) {
    INTERN(s_fast, "fast"); INTERN(s_depth, "depth"); INTERN(s_pending, "pending");
    INTERN(s_optimizers_seen, "optimizers_seen"); INTERN(s_in_data, "_in_data"); INTERN(s_begin, "begin");
    INTERN(s_end, "end"); INTERN(s_on_error, "_on_error"); INTERN(s_hooks, "hooks"); INTERN(s_single, "single");
    INTERN(s_explicit, "explicit"); INTERN(s_discovering, "_discovering");
    INTERN(s_finish_discovery, "finish_discovery"); INTERN(s_boundary, "_boundary");
    INTERN(s_note_optimizer, "_note_optimizer"); INTERN(s_dim, "dim"); INTERN(s_shape, "shape");
    INTERN(s_values, "values"); INTERN(s_data, "data"); INTERN(s_optimizer, "optimizer"); INTERN(s_key, "key");
    INTERN(s_forward, "forward"); INTERN(s_in_root, "_in_root");
    INTERN(s_commands, "commands"); INTERN(s_boundaries, "boundaries"); INTERN(s_window, "window");
    INTERN(s_flops_mode, "flops_mode"); INTERN(s_memory, "memory"); INTERN(s_next_every, "_next_every");
    INTERN(s_next_time, "_next_time"); INTERN(s_after_count, "after_count");
    if ((kw_key = PyTuple_Pack(1, s_key)) == NULL) return NULL;
    if ((code_begin = PyLong_FromLong(BEGIN)) == NULL || (code_end = PyLong_FromLong(END)) == NULL
        || (code_end_boundary = PyLong_FromLong(END_BOUNDARY)) == NULL)
        return NULL;
    if (PyType_Ready(&TimedType) < 0 || PyType_Ready(&OptimizerHookType) < 0 || PyType_Ready(&ForwardType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hot_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Timed", (PyObject *)&TimedType) < 0
        || PyModule_AddObjectRef(m, "OptimizerHook", (PyObject *)&OptimizerHookType) < 0
        || PyModule_AddObjectRef(m, "Forward", (PyObject *)&ForwardType) < 0
        || PyModule_AddIntConstant(m, "DATA", KIND_DATA) < 0
        || PyModule_AddIntConstant(m, "BACKWARD", KIND_BACKWARD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
