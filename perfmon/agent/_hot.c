/* perfmon's hook hot path in C: the same events as the Python hooks in hooks.py, without a Python frame.
 *
 * Optional: built by `pip install` where a C compiler exists; perfmon falls back to pure Python otherwise (or with
 * PERFMON_NO_ACCEL=1). Inside a real training loop torch's own work between two hooks leaves the hooks' code and
 * data cache-cold, so what a hook costs is mostly the cache lines it touches. Hence:
 *
 *  - State: the training thread's hot state (step depth, the loop's one optimizer, where events go, ...) in one C
 *    struct. ``steps.Boundaries`` subclasses it; Python reads and writes the same fields as attributes.
 *  - CommandState: the few fields of ``commands.Commands`` a step's end looks at, and the boundary count.
 *  - Ring: the event buffer. Python appends whole event tuples; the C hooks write compact 24-byte slots (no
 *    object made on the training thread) that ``drain`` turns into the very tuples the Python hooks append.
 *  - Timed, OptimizerHook, Forward: the hooks. Each does its common case (host timing only, no step decision
 *    to make) here and calls the same Python method as the Python hook for every other case
 *    (``Instrumentation.begin``/``end``), so the step logic lives in one place. Nothing here raises into
 *    training: a failure of the bookkeeping goes to ``inst._on_error``.
 *
 * Event tuples are ``(code, t, arg, None)``, t on time.perf_counter's clock (CLOCK_MONOTONIC, in seconds).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "structmember.h"

/* event codes: perfmon.agent.steps */
#define BEGIN 0
#define END 1
#define PREFETCH 4  /* a fetch on another thread ended: arg (its seconds, its samples or None) */
#define END_BOUNDARY 6
#define STEADY 7  /* one steady iteration's events, folded by Ring.drain */

/* what a Timed wraps */
#define KIND_DATA 0
#define KIND_BACKWARD 1

/* phases, in the order of `phase_names` */
#define PH_DATA 0
#define PH_FORWARD 1
#define PH_BACKWARD 2
#define PH_OPTIMIZER 3

/* what a slot's arg is */
#define TAG_OBJ 0        /* the whole event is `obj` (appended from Python) */
#define TAG_PHASE 1      /* phase_names[kind] */
#define TAG_DATA 2       /* ("data", n) */
#define TAG_DATA_NONE 3  /* ("data", None); kind 1: ("data", False), the fetch raised (StopIteration: the loader is done) */
#define TAG_FORWARD 4    /* ("forward", id(ptr), kind) */
#define TAG_OPTIMIZER 5  /* ("optimizer", id(ptr)) */

static PyObject *s_on_error, *s_hooks, *s_begin, *s_end, *s_finish_discovery, *s_boundary, *s_note_optimizer,
    *s_root_class_call, *s_wrap_closure, *s_emit, *s_closure, *s_size, *s_values, *s_key, *s_after_count, *s_training;
static PyObject *kw_key;  /* ("key",) */
static PyObject *phase_names[4];
static PyObject *codes[8];
static PyObject *zero;

/* time.perf_counter(), without the call or the float */
static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return (double)ns / 1e9;
}

static inline int is_none(PyObject *o) { return o == NULL || o == Py_None; }

/* -- perfmon's Python, run eagerly from inside compiled code ---------------------------------------------
 * A hook that code made by torch.compile calls (an optimizer step compiled with it: dynamo cannot trace a C hook,
 * so the compiled code calls it as it is) runs with dynamo's frame callback set on this thread, and every Python
 * frame perfmon's bookkeeping then enters would be compiled as a frame of its own (graph breaks, recompiles, and
 * dynamo's errors on perfmon's code). Around those calls the callback is put aside, as torch.compiler.disable
 * does, and put back after. Nothing is done while no frame evaluator but CPython's is installed (PEP 523). */

static PyObject *set_eval_frame;  /* torch._C._dynamo.eval_frame.set_eval_frame, once found */

/* The callback to put back (a new reference), or NULL where there is none. Keeps any error already set. */
static PyObject *eager_begin(void) {
    PyThreadState *ts = PyThreadState_Get();
    if (_PyInterpreterState_GetEvalFrameFunc(PyThreadState_GetInterpreter(ts)) == _PyEval_EvalFrameDefault)
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *prev = NULL;
    if (set_eval_frame == NULL) {
        PyObject *name = PyUnicode_FromString("torch._C._dynamo.eval_frame");
        PyObject *mod = name == NULL ? NULL : PyImport_GetModule(name);  /* only if loaded: no import here */
        Py_XDECREF(name);
        if (mod != NULL) {
            set_eval_frame = PyObject_GetAttrString(mod, "set_eval_frame");
            Py_DECREF(mod);
        }
    }
    if (set_eval_frame != NULL) {
        prev = PyObject_CallOneArg(set_eval_frame, Py_None);
        if (prev == Py_None) Py_CLEAR(prev);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    return prev;
}

static void eager_end(PyObject *prev) {
    if (prev == NULL) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallOneArg(set_eval_frame, prev);
    Py_XDECREF(r);
    Py_DECREF(prev);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* An error of perfmon's own bookkeeping: to inst._on_error("hooks", exc), never into training. */
static void report(PyObject *inst) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyObject *dyn = eager_begin();
        PyObject *r = PyObject_CallMethodObjArgs(inst, s_on_error, s_hooks, value, NULL);
        eager_end(dyn);
        Py_XDECREF(r);
    }
    PyErr_Clear();
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* -- Ring: the event buffer ------------------------------------------------------------------------------ */

typedef struct {
    double t;
    union { PyObject *obj; const void *ptr; long n; } aux;
    int8_t code, tag, kind;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *buf, *spare;
    Py_ssize_t cap, head, len, maxlen;
    long long dropped;
    PyObject *wake;      /* called when the ring comes to hold wake_at events (the publisher's alarm), or NULL */
    Py_ssize_t wake_at;
} Ring;

static PyTypeObject RingType;

/* Room for one more slot: grow up to maxlen, then drop the oldest (a deque with maxlen does the same). The
 * ring is consistent before any object is released: a finalizer may run Python code and switch threads. */
static Slot *ring_next(Ring *r) {
    PyObject *dropped = NULL;
    if (r->len == r->cap) {
        if (r->cap < r->maxlen) {
            Py_ssize_t cap = r->cap ? r->cap * 2 : 1024;
            if (cap > r->maxlen) cap = r->maxlen;
            Slot *buf = PyMem_RawMalloc((size_t)cap * sizeof(Slot));
            if (buf == NULL) { PyErr_NoMemory(); return NULL; }
            for (Py_ssize_t i = 0; i < r->len; i++) buf[i] = r->buf[(r->head + i) % r->cap];
            PyMem_RawFree(r->buf);
            PyMem_RawFree(r->spare);  /* the wrong size now */
            r->spare = NULL;
            r->buf = buf;
            r->cap = cap;
            r->head = 0;
        } else {
            Slot *old = &r->buf[r->head];
            if (old->tag == TAG_OBJ) dropped = old->aux.obj;
            r->head = (r->head + 1) % r->cap;
            r->len--;
            r->dropped++;
        }
    }
    Slot *s = &r->buf[(r->head + r->len) % r->cap];
    r->len++;
    s->tag = TAG_PHASE;  /* a placeholder the caller overwrites, never an object to release */
    Py_XDECREF(dropped);
    return s;
}

/* The ring came to hold wake_at events: call `wake` (the publisher sleeps long while a job does not step, and a
 * burst must not fill the ring meanwhile). Its result and any error are dropped: nothing reaches the training
 * thread, except Ctrl-C: a KeyboardInterrupt a signal handler raised inside the call is delivered again (the agent's
 * alarm, a SimpleQueue's put, runs no Python code, so that takes another callable). Called with the slot written, so
 * the ring is consistent if the call switches threads. */
static void ring_wake(Ring *r) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *wake = Py_NewRef(r->wake);
    PyObject *res = PyObject_CallNoArgs(wake);
    Py_DECREF(wake);
    if (res == NULL) {
        int interrupted = PyErr_ExceptionMatches(PyExc_KeyboardInterrupt);
        PyErr_Clear();
        if (interrupted) PyErr_SetInterrupt();  /* raised again at the next check, in the training thread's code */
    } else {
        Py_DECREF(res);
    }
    PyErr_Restore(type, value, tb);
}

static inline void ring_filled(Ring *r) {
    if (r->len == r->wake_at && r->wake != NULL) ring_wake(r);
}

static inline int ring_push(Ring *r, int code, int tag, int kind, const void *ptr, long n) {
    Slot *s = ring_next(r);
    if (s == NULL) return -1;
    s->t = now();
    s->code = (int8_t)code;
    s->tag = (int8_t)tag;
    s->kind = (int8_t)kind;
    if (tag == TAG_DATA) s->aux.n = n;
    else s->aux.ptr = ptr;
    ring_filled(r);
    return 0;
}

/* id() of the objects a drain meets, made once per drain for each (a loop passes the same model and optimizer) */
typedef struct { const void *ptr[2]; PyObject *obj[2]; } Ids;

static PyObject *id_of(Ids *ids, const void *ptr) {
    int k = ids == NULL ? -1 : ids->ptr[0] == ptr ? 0 : ids->ptr[1] == ptr ? 1 : -1;
    if (k >= 0 && ids->obj[k] != NULL) return Py_NewRef(ids->obj[k]);
    PyObject *r = PyLong_FromVoidPtr((void *)ptr);
    if (r != NULL && ids != NULL) {
        k = ids->obj[0] == NULL ? 0 : 1;
        Py_XSETREF(ids->obj[k], Py_NewRef(r));
        ids->ptr[k] = ptr;
    }
    return r;
}

/* the arg of a compact event, as the Python hooks make it */
static PyObject *make_arg_ids(int tag, int kind, const void *ptr, long n, Ids *ids) {
    PyObject *a, *b, *r;
    switch (tag) {
    case TAG_PHASE:
        return Py_NewRef(phase_names[kind]);
    case TAG_DATA:
        if ((a = PyLong_FromLong(n)) == NULL) return NULL;
        r = PyTuple_Pack(2, phase_names[PH_DATA], a);
        Py_DECREF(a);
        return r;
    case TAG_DATA_NONE:
        return PyTuple_Pack(2, phase_names[PH_DATA], kind ? Py_False : Py_None);
    case TAG_FORWARD:
        if ((a = id_of(ids, ptr)) == NULL) return NULL;
        if ((b = PyLong_FromLong(kind)) == NULL) { Py_DECREF(a); return NULL; }
        r = PyTuple_Pack(3, phase_names[PH_FORWARD], a, b);
        Py_DECREF(a); Py_DECREF(b);
        return r;
    case TAG_OPTIMIZER:
        if ((a = id_of(ids, ptr)) == NULL) return NULL;
        r = PyTuple_Pack(2, phase_names[PH_OPTIMIZER], a);
        Py_DECREF(a);
        return r;
    }
    PyErr_SetString(PyExc_SystemError, "perfmon: unknown event slot");
    return NULL;
}

static PyObject *make_arg(int tag, int kind, const void *ptr, long n) { return make_arg_ids(tag, kind, ptr, n, NULL); }

static PyObject *make_event(int code, double t, PyObject *arg) {
    PyObject *tf = PyFloat_FromDouble(t);
    if (tf == NULL) return NULL;
    PyObject *ev = PyTuple_Pack(4, codes[code], tf, arg, Py_None);
    Py_DECREF(tf);
    return ev;
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t maxlen;
    static char *names[] = {"maxlen", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, &maxlen)) return NULL;
    if (maxlen < 1) { PyErr_SetString(PyExc_ValueError, "maxlen must be at least 1"); return NULL; }
    Ring *self = (Ring *)type->tp_alloc(type, 0);
    if (self != NULL) self->maxlen = maxlen;
    return (PyObject *)self;
}

static void release_slots(Slot *buf, Py_ssize_t cap, Py_ssize_t head, Py_ssize_t len) {
    for (Py_ssize_t i = 0; i < len; i++) {
        Slot *s = &buf[(head + i) % cap];
        if (s->tag == TAG_OBJ) Py_DECREF(s->aux.obj);
    }
}

static void Ring_dealloc(Ring *self) {
    Slot *buf = self->buf;
    Py_ssize_t cap = self->cap, head = self->head, len = self->len;
    self->buf = NULL;
    self->len = self->cap = 0;
    Py_CLEAR(self->wake);
    release_slots(buf, cap, head, len);
    PyMem_RawFree(buf);
    PyMem_RawFree(self->spare);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* a whole event object on the ring (Python's appends, and the hooks' events without a compact form) */
static int ring_push_obj(Ring *r, PyObject *event) {
    Slot *s = ring_next(r);
    if (s == NULL) return -1;
    s->aux.obj = Py_NewRef(event);
    s->tag = TAG_OBJ;
    ring_filled(r);
    return 0;
}

static PyObject *Ring_append(Ring *self, PyObject *event) {
    if (ring_push_obj(self, event) < 0) return NULL;
    Py_RETURN_NONE;
}

#define AT(k) (&buf[(head + (k)) % cap])

/* How many slots from i make one steady iteration: [fetch] forward(grad) backward optimizer, each begun and ended
 * at top level by the C hooks, the optimizer's end ending the step. 8 or 6, or 0 for anything else. */
static Py_ssize_t steady_len(Slot *buf, Py_ssize_t cap, Py_ssize_t head, Py_ssize_t i, Py_ssize_t len) {
    Py_ssize_t j = i;
    Slot *s = AT(i);
    if (s->code == BEGIN && s->tag == TAG_PHASE && s->kind == PH_DATA) {
        if (i + 8 > len) return 0;
        Slot *e = AT(i + 1);
        if (e->code != END || (e->tag != TAG_DATA && (e->tag != TAG_DATA_NONE || e->kind))) return 0;
        j = i + 2;
    } else if (i + 6 > len) {
        return 0;
    }
    Slot *a = AT(j), *b = AT(j + 1), *c = AT(j + 2), *d = AT(j + 3), *e = AT(j + 4), *f = AT(j + 5);
    if (a->code == BEGIN && a->tag == TAG_FORWARD && a->kind == 0 /* GRAD */
        && b->code == END && b->tag == TAG_PHASE && b->kind == PH_FORWARD
        && c->code == BEGIN && c->tag == TAG_PHASE && c->kind == PH_BACKWARD
        && d->code == END && d->tag == TAG_PHASE && d->kind == PH_BACKWARD
        && e->code == BEGIN && e->tag == TAG_PHASE && e->kind == PH_OPTIMIZER
        && f->code == END_BOUNDARY && f->tag == TAG_OPTIMIZER)
        return j + 6 - i;
    return 0;
}

static inline PyObject *float_or_none(int some, double t) { return some ? PyFloat_FromDouble(t) : Py_NewRef(Py_None); }

/* (STEADY, t_end, (t_fetch, t_fetched, samples, t_forward, model id, t_forwarded, t_backward, t_backwarded,
 * t_optimizer, optimizer id), None): steps.expand_steady gives back the events it stands for. */
static PyObject *make_steady(Slot *buf, Py_ssize_t cap, Py_ssize_t head, Py_ssize_t i, Py_ssize_t k, Ids *ids) {
    int fetch = k == 8;
    Slot *s = AT(i), *j = AT(i + (fetch ? 2 : 0));
    Slot *fwe = AT(i + k - 5), *bw = AT(i + k - 4), *bwe = AT(i + k - 3), *op = AT(i + k - 2),
         *ope = AT(i + k - 1);
    PyObject *items[10] = {
        float_or_none(fetch, s->t),
        float_or_none(fetch, fetch ? AT(i + 1)->t : 0.0),
        fetch && AT(i + 1)->tag == TAG_DATA ? PyLong_FromLong(AT(i + 1)->aux.n) : Py_NewRef(Py_None),
        PyFloat_FromDouble(j->t),
        id_of(ids, j->aux.ptr),
        PyFloat_FromDouble(fwe->t),
        PyFloat_FromDouble(bw->t),
        PyFloat_FromDouble(bwe->t),
        PyFloat_FromDouble(op->t),
        id_of(ids, ope->aux.ptr),
    };
    PyObject *payload = NULL, *ev = NULL;
    int ok = 1;
    for (int q = 0; q < 10; q++) ok = ok && items[q] != NULL;
    if (ok && (payload = PyTuple_New(10)) != NULL) {
        for (int q = 0; q < 10; q++) PyTuple_SET_ITEM(payload, q, items[q]);
        ev = make_event(STEADY, ope->t, payload);
        Py_DECREF(payload);
    } else {
        for (int q = 0; q < 10; q++) Py_XDECREF(items[q]);
    }
    return ev;
}

/* Every event so far, oldest first, as a list of tuples. The slots are taken off the ring before any object is
 * made (making one can run Python code, and the training thread may append meanwhile). */
static PyObject *Ring_drain(Ring *self, PyObject *args, PyObject *kwargs) {
    int fold = 1;
    static char *names[] = {"fold", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p", names, &fold)) return NULL;
    Slot *buf = self->buf;
    Py_ssize_t cap = self->cap, head = self->head, len = self->len;
    if (len == 0) return PyList_New(0);
    self->buf = self->spare;
    self->spare = NULL;
    if (self->buf == NULL) {
        self->buf = PyMem_RawMalloc((size_t)cap * sizeof(Slot));
        if (self->buf == NULL) {
            self->buf = buf;
            return PyErr_NoMemory();
        }
    }
    self->head = self->len = 0;
    PyObject *list = PyList_New(0);
    Ids ids = {{NULL, NULL}, {NULL, NULL}};
    Py_ssize_t i = 0;
    while (list != NULL && i < len) {
        Slot *s = AT(i);
        PyObject *ev;
        Py_ssize_t k = s->tag == TAG_OBJ || !fold ? 0 : steady_len(buf, cap, head, i, len);
        if (k) {
            ev = make_steady(buf, cap, head, i, k, &ids);
        } else if (s->tag == TAG_OBJ) {
            ev = s->aux.obj;  /* the ring's reference goes to the list */
            s->tag = TAG_PHASE;
            k = 1;
        } else {
            PyObject *arg = make_arg_ids(s->tag, s->kind, s->aux.ptr, s->aux.n, &ids);
            ev = arg == NULL ? NULL : make_event(s->code, s->t, arg);
            Py_XDECREF(arg);
            k = 1;
        }
        if (ev == NULL || PyList_Append(list, ev) < 0) { Py_XDECREF(ev); Py_CLEAR(list); break; }
        Py_DECREF(ev);
        i += k;
    }
    Py_XDECREF(ids.obj[0]);
    Py_XDECREF(ids.obj[1]);
    if (list == NULL) release_slots(buf, cap, head + i, len - i);
    if (self->spare == NULL && cap == self->cap) self->spare = buf;
    else PyMem_RawFree(buf);
    return list;
}

static Py_ssize_t Ring_length(Ring *self) { return self->len; }

static PyMethodDef Ring_methods[] = {
    {"append", (PyCFunction)Ring_append, METH_O, "Append one event tuple (code, t, arg, mark)."},
    {"drain", (PyCFunction)(void (*)(void))Ring_drain, METH_VARARGS | METH_KEYWORDS,
     "drain(fold=True): every event so far, oldest first, as a list of tuples; with fold, each steady "
     "iteration the C hooks recorded comes as one STEADY event (steps.expand_steady)."},
    {NULL},
};

static PyMemberDef Ring_members[] = {
    {"maxlen", T_PYSSIZET, offsetof(Ring, maxlen), READONLY, "the most events held; older ones are dropped"},
    {"dropped", T_LONGLONG, offsetof(Ring, dropped), READONLY, "events dropped because the ring was full"},
    {"wake_at", T_PYSSIZET, offsetof(Ring, wake_at), 0, "wake() is called when the ring comes to hold this many"},
    {NULL},
};

static PyObject *Ring_get_wake(Ring *self, void *Py_UNUSED(closure)) {
    return Py_NewRef(self->wake != NULL ? self->wake : Py_None);
}

static int Ring_set_wake(Ring *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value != NULL && value != Py_None && !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "wake must be callable or None");
        return -1;
    }
    Py_XSETREF(self->wake, value == NULL || value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}

static PyGetSetDef Ring_getset[] = {
    {"wake", (getter)Ring_get_wake, (setter)Ring_set_wake,
     "called (no arguments, from the appending thread) when the ring comes to hold wake_at events; None: never. "
     "The ring is not tracked by the garbage collector: a wake that refers back to its ring keeps both alive.",
     NULL},
    {NULL},
};

static PySequenceMethods Ring_as_sequence = {.sq_length = (lenfunc)Ring_length};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.Ring",
    .tp_doc = "Ring(maxlen): the agent's event buffer (append from Python, compact slots from the C hooks).",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Ring_new,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_members = Ring_members,
    .tp_getset = Ring_getset,
    .tp_as_sequence = &Ring_as_sequence,
};

/* -- State: the training thread's hot state (the base of steps.Boundaries) -------------------------------- */

typedef struct {
    PyObject_HEAD
    long depth, in_data, in_root, in_backward;
    unsigned long train_thread;  /* the thread that trains (the last to run a backward); 0: not known */
    unsigned long prev_thread;  /* the thread that trained before train_thread */
    unsigned long thread_returns;  /* backwards back on the thread before the last one: loops side by side */
    char pending, explicit_, optimizers_seen, discovering;
    PyObject *single;    /* id() of the loop's one optimizer, once learned, or None */
    PyObject *ring;      /* the agent's Ring while the hooks may write to it, else None */
    PyObject *sink;      /* Instrumentation.fast: a callable taking one event tuple, or None */
    PyObject *commands;  /* the agent's Commands (a CommandState), or None */
    PyObject *engine_node;  /* torch._C._current_autograd_node: not None inside the autograd engine */
} State;

/* -- CommandState: what a step's end looks at of commands.Commands --------------------------------------- */

typedef struct {
    PyObject_HEAD
    long long boundaries;
    char pending;
    PyObject *window, *flops_mode, *memory, *next_every, *next_time;
} CommandState;

static PyTypeObject StateType, CommandStateType;

static int State_traverse(State *self, visitproc visit, void *arg) {
    Py_VISIT(self->single); Py_VISIT(self->ring); Py_VISIT(self->sink); Py_VISIT(self->commands);
    Py_VISIT(self->engine_node);
    return 0;
}

static int State_clear(State *self) {
    Py_CLEAR(self->single); Py_CLEAR(self->ring); Py_CLEAR(self->sink); Py_CLEAR(self->commands);
    Py_CLEAR(self->engine_node);
    return 0;
}

static void State_dealloc(State *self) {
    PyObject_GC_UnTrack(self);
    State_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ring and commands are typed (the hooks use them as C structs): set through these */
static PyObject *State_get_ring(State *self, void *c) { (void)c; return Py_NewRef(self->ring ? self->ring : Py_None); }
static int State_set_ring(State *self, PyObject *value, void *c) {
    (void)c;
    if (value != NULL && value != Py_None && !Py_IS_TYPE(value, &RingType)) {
        PyErr_SetString(PyExc_TypeError, "ring must be a Ring or None");
        return -1;
    }
    Py_XSETREF(self->ring, value == NULL || value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}
static PyObject *State_get_commands(State *self, void *c) {
    (void)c;
    return Py_NewRef(self->commands ? self->commands : Py_None);
}
static int State_set_commands(State *self, PyObject *value, void *c) {
    (void)c;
    if (value != NULL && value != Py_None && !PyObject_TypeCheck(value, &CommandStateType)) {
        PyErr_SetString(PyExc_TypeError, "commands must be a CommandState or None");
        return -1;
    }
    Py_XSETREF(self->commands, value == NULL || value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}

static PyMemberDef State_members[] = {
    {"depth", T_LONG, offsetof(State, depth), 0, "phases open on the training thread"},
    {"in_data", T_LONG, offsetof(State, in_data), 0, "inside a DataLoader fetch (module calls there are transforms)"},
    {"in_root", T_LONG, offsetof(State, in_root), 0, "inside a root's forward (same-class submodules are not roots)"},
    {"in_backward", T_LONG, offsetof(State, in_backward), 0,
     "inside a backward (module calls there recompute checkpointed activations: backward time)"},
    {"train_thread", T_ULONG, offsetof(State, train_thread), 0,
     "threading.get_ident() of the thread that trains; fetches and forwards on others are not its steps' time"},
    {"prev_thread", T_ULONG, offsetof(State, prev_thread), 0, "the thread that trained before train_thread"},
    {"thread_returns", T_ULONG, offsetof(State, thread_returns), 0,
     "backwards back on the thread that trained before the last one (two loops training at once take turns)"},
    {"pending", T_BOOL, offsetof(State, pending), 0, "a step's update ended: the next iteration ends the step"},
    {"explicit", T_BOOL, offsetof(State, explicit_), 0, "perfmon.step() ends steps"},
    {"optimizers_seen", T_BOOL, offsetof(State, optimizers_seen), 0, "an optimizer exists: a backward ends no step"},
    {"discovering", T_BOOL, offsetof(State, discovering), 0, "looking for the root modules"},
    {"single", T_OBJECT, offsetof(State, single), 0, "id() of the loop's one optimizer, or None"},
    {"sink", T_OBJECT, offsetof(State, sink), 0, "where events go while host timing is all there is, or None"},
    {"engine_node", T_OBJECT, offsetof(State, engine_node), 0,
     "torch._C._current_autograd_node, or None: a backward called inside the autograd engine is a nested one"},
    {NULL},
};

static PyGetSetDef State_getset[] = {
    {"ring", (getter)State_get_ring, (setter)State_set_ring, "the Ring events go to (the C hooks), or None", NULL},
    {"commands", (getter)State_get_commands, (setter)State_set_commands, "the agent's Commands, or None", NULL},
    {NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.State",
    .tp_doc = "The training thread's hot state, read by the C hooks as a struct (steps.Boundaries' base).",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)State_traverse,
    .tp_clear = (inquiry)State_clear,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_members = State_members,
    .tp_getset = State_getset,
};

static int CommandState_traverse(CommandState *self, visitproc visit, void *arg) {
    Py_VISIT(self->window); Py_VISIT(self->flops_mode); Py_VISIT(self->memory); Py_VISIT(self->next_every);
    Py_VISIT(self->next_time);
    return 0;
}

static int CommandState_clear(CommandState *self) {
    Py_CLEAR(self->window); Py_CLEAR(self->flops_mode); Py_CLEAR(self->memory); Py_CLEAR(self->next_every);
    Py_CLEAR(self->next_time);
    return 0;
}

static void CommandState_dealloc(CommandState *self) {
    PyObject_GC_UnTrack(self);
    CommandState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef CommandState_members[] = {
    {"boundaries", T_LONGLONG, offsetof(CommandState, boundaries), 0, "step boundaries so far"},
    {"pending", T_BOOL, offsetof(CommandState, pending), 0, "a request waits for a step boundary"},
    {"window", T_OBJECT, offsetof(CommandState, window), 0, "the profiler window being captured, or None"},
    {"flops_mode", T_OBJECT, offsetof(CommandState, flops_mode), 0, "a FLOP count in progress, or None"},
    {"memory", T_OBJECT, offsetof(CommandState, memory), 0, "the memory-snapshot flow, once asked for, or None"},
    {"_next_every", T_OBJECT, offsetof(CommandState, next_every), 0, "the boundary of the next periodic window"},
    {"_next_time", T_OBJECT, offsetof(CommandState, next_time), 0, "the monotonic time of the next one"},
    {NULL},
};

static PyTypeObject CommandStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.CommandState",
    .tp_doc = "What a step's end looks at of commands.Commands (its base), read by the C hooks as a struct.",
    .tp_basicsize = sizeof(CommandState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)CommandState_traverse,
    .tp_clear = (inquiry)CommandState_clear,
    .tp_dealloc = (destructor)CommandState_dealloc,
    .tp_members = CommandState_members,
};

/* -- what every hook shares ------------------------------------------------------------------------------- */

/* the fast path is on: host timing is all there is to record (Instrumentation.fast is set) */
static inline int fast_on(State *st) { return st->ring != NULL || !is_none(st->sink); }

/* A whole event tuple to the sink (the ring takes its compact form instead). -1 with an error set. */
static int to_sink(State *st, PyObject *ev) {
    PyObject *sink = Py_NewRef(st->sink);
    PyObject *dyn = eager_begin();
    PyObject *r = PyObject_CallOneArg(sink, ev);
    eager_end(dyn);
    Py_DECREF(sink);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The common case's event, now: a compact slot on the ring, else a tuple to the sink. -1 with an error set. */
static int emit(State *st, int code, int tag, int kind, const void *ptr, long n) {
    if (st->ring != NULL) return ring_push((Ring *)st->ring, code, tag, kind, ptr, n);
    PyObject *arg = make_arg(tag, kind, ptr, n);
    if (arg == NULL) return -1;
    PyObject *ev = make_event(code, now(), arg);
    Py_DECREF(arg);
    if (ev == NULL) return -1;
    int r = to_sink(st, ev);
    Py_DECREF(ev);
    return r;
}

/* The same, for an arg with no compact form. */
static int emit_obj(State *st, int code, PyObject *arg) {
    PyObject *ev = make_event(code, now(), arg);
    if (ev == NULL) return -1;
    int r = st->ring != NULL ? ring_push_obj((Ring *)st->ring, ev) : to_sink(st, ev);
    Py_DECREF(ev);
    return r;
}

/* inst._emit(code, arg): an event without the fast path (Instrumentation.fast unset). -1 with an error set. */
static int call_slow_emit(PyObject *inst, int code, PyObject *arg) {
    PyObject *dyn = eager_begin();
    PyObject *r = PyObject_CallMethodObjArgs(inst, s_emit, codes[code], arg, NULL);
    eager_end(dyn);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* inst.begin(phase) or inst.begin(phase, key=key): the Python hooks' slow path, which catches its own errors */
static void call_slow(PyObject *inst, PyObject *method, PyObject *phase, PyObject *arg, PyObject *key) {
    PyObject *r, *dyn = eager_begin();
    if (key != NULL) {  /* inst.method(phase, arg, key=key) */
        PyObject *call[4] = {inst, phase, arg != NULL ? arg : Py_None, key};
        r = PyObject_VectorcallMethod(method, call, 3, kw_key);
    } else if (arg != NULL) {
        r = PyObject_CallMethodObjArgs(inst, method, phase, arg, NULL);
    } else {
        r = PyObject_CallMethodObjArgs(inst, method, phase, NULL);
    }
    eager_end(dyn);
    if (r == NULL) report(inst);
    else Py_DECREF(r);
}

/* The step ended: the commands' boundary. With the agent's Commands at hand, count the boundary and look at what
 * could be due (the common case: nothing, and no Python call); else Instrumentation._boundary(). */
static void step_ended(State *st, PyObject *inst) {
    PyObject *r, *dyn;
    if (st->commands == NULL) {
        dyn = eager_begin();
        r = PyObject_CallMethodNoArgs(inst, s_boundary);
        eager_end(dyn);
    } else {
        CommandState *c = (CommandState *)st->commands;
        c->boundaries++;
        if (!c->pending && is_none(c->window) && is_none(c->flops_mode) && is_none(c->memory)
            && is_none(c->next_every) && is_none(c->next_time))
            return;
        Py_INCREF(c);
        dyn = eager_begin();
        r = PyObject_CallMethodNoArgs((PyObject *)c, s_after_count);
        eager_end(dyn);
        Py_DECREF(c);
    }
    if (r == NULL) report(inst);
    Py_XDECREF(r);
}

/* A list or tuple of dicts with the same keys: per-sample records (detectron2's list of dicts, torchvision
 * detection's targets; not default_collate's [inputs_dict, labels]); 1 for records, 0 for not, -1 with an error
 * set. As hooks._records. */
static int records(PyObject *seq) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) return 0;
    Py_ssize_t n = PySequence_Size(seq);
    if (n <= 0) return n < 0 ? -1 : 0;
    PyObject *first = PySequence_GetItem(seq, 0);
    if (first == NULL) return -1;
    int r = PyDict_Check(first);
    for (Py_ssize_t i = 1; r == 1 && i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (item == NULL) { r = -1; break; }
        if (!PyDict_Check(item) || PyDict_Size(item) != PyDict_Size(first)) {
            r = 0;
        } else {
            PyObject *key;
            Py_ssize_t pos = 0;
            while (r == 1 && PyDict_Next(first, &pos, &key, NULL)) {
                int has = PyDict_Contains(item, key);
                if (has < 0) r = -1;
                else if (!has) r = 0;
            }
        }
        Py_DECREF(item);
    }
    Py_DECREF(first);
    return r;
}

/* hooks.batch_size: leading dimension of the first tensor found (a few containers deep), or the number of records
 * of a batch of per-sample records (hooks.batch_size says which); NULL with no error for None. A failure of an odd
 * batch type is None, as in Python (only non-Exception errors propagate). */
static PyObject *batch_size(PyObject *batch, PyObject *tensor_type) {
    int rec = records(batch);
    if (rec < 0) goto failed;
    if (rec) return PyLong_FromSsize_t(PySequence_Size(batch));
    if ((PyList_Check(batch) || PyTuple_Check(batch)) && PySequence_Size(batch) >= 2) {
        PyObject *first = PySequence_GetItem(batch, 0);  /* only where the first item is no tensor (as hooks.py) */
        if (first == NULL) goto failed;
        int nested = PyList_Check(first) || PyTuple_Check(first);
        Py_DECREF(first);
        if (!nested) goto leading;
        PyObject *second = PySequence_GetItem(batch, 1);
        if (second == NULL) goto failed;
        rec = records(second);
        Py_ssize_t n = rec > 0 ? PySequence_Size(second) : 0;
        Py_DECREF(second);
        if (rec < 0 || n < 0) goto failed;
        if (rec) return PyLong_FromSsize_t(n);
    }
leading:
    Py_INCREF(batch);
    for (int depth = 0; depth < 4; depth++) {
        int is_tensor = PyObject_IsInstance(batch, tensor_type);
        if (is_tensor < 0) goto fail;
        if (is_tensor) {  /* batch.size(0): an IndexError for a 0-d tensor, which is None */
            PyObject *n = PyObject_CallMethodOneArg(batch, s_size, zero);
            Py_DECREF(batch);
            if (n == NULL) goto failed;
            PyObject *r = PyNumber_Long(n);
            Py_DECREF(n);
            if (r == NULL) goto failed;
            return r;
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
failed:
    if (PyErr_ExceptionMatches(PyExc_Exception)) PyErr_Clear();
    return NULL;
}

static int check_state(PyObject *bounds) {
    if (PyObject_TypeCheck(bounds, &StateType)) return 0;
    PyErr_SetString(PyExc_TypeError, "bounds must be a perfmon.agent._hot.State (steps.Boundaries)");
    return -1;
}

/* -- Timed: a wrapped function or method (DataLoader fetch, torch.autograd.backward) ------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig, *inst, *bounds, *phase, *tensor_type, *dict;
    int kind;
} Timed;

/* A backward called from inside the autograd engine (a reentrant checkpoint's, on autograd's device thread): not a
 * thread that trains. Asked only while some backward runs, and only on a thread that is not the training one. */
static int nested_backward(State *st) {
    if (st->in_backward == 0 || st->engine_node == NULL || st->engine_node == Py_None) return 0;
    PyObject *node = PyObject_CallNoArgs(st->engine_node);
    if (node == NULL) {
        PyErr_Clear();
        return 0;
    }
    int nested = node != Py_None;
    Py_DECREF(node);
    return nested;
}

static PyObject *Timed_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Timed *self = (Timed *)op;
    PyObject *inst = self->inst;
    State *st = (State *)self->bounds;
    int data = self->kind == KIND_DATA;
    int phase = data ? PH_DATA : PH_BACKWARD;
    unsigned long me = PyThread_get_thread_ident();
    if (!data) {  /* a backward: this thread trains */
        if (st->train_thread != me && !nested_backward(st)) {
            if (st->train_thread != 0 && me == st->prev_thread) st->thread_returns++;
            st->prev_thread = st->train_thread;
            st->train_thread = me;
        }
    }
    else if (st->train_thread != 0 && st->train_thread != me) {
        /* a prefetching thread: it overlaps the steps; how long it fetches is counted apart */
        double t0 = now();
        PyObject *result = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        if (result != NULL) {
            double seconds = now() - t0;
            PyObject *n = batch_size(result, self->tensor_type);
            if (n == NULL && PyErr_Occurred()) {  /* a KeyboardInterrupt while sizing: it goes up, as in Python */
                Py_DECREF(result);
                return NULL;
            }
            PyObject *arg = Py_BuildValue("(dO)", seconds, n != NULL ? n : Py_None);
            Py_XDECREF(n);
            int r = arg == NULL ? -1 : fast_on(st) ? emit_obj(st, PREFETCH, arg) : call_slow_emit(inst, PREFETCH, arg);
            Py_XDECREF(arg);
            if (r < 0) report(inst);
        }
        return result;
    }

    /* begin: the common case inline, else Instrumentation.begin */
    if (fast_on(st) && (st->depth || !st->pending)) {
        st->depth++;
        if (emit(st, BEGIN, TAG_PHASE, phase, NULL, 0) < 0) report(inst);
    } else {
        call_slow(inst, s_begin, self->phase, NULL, NULL);
    }
    if (data) st->in_data++;
    else st->in_backward++;

    PyObject *result = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);

    /* end, whatever the call did (its exception is kept and re-raised) */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *n = NULL;
    if (!data) st->in_backward--;
    if (data) {
        st->in_data--;
        if (result != NULL) {
            n = batch_size(result, self->tensor_type);
            if (n == NULL && PyErr_Occurred()) {  /* a KeyboardInterrupt while sizing: it goes up, as in Python */
                Py_CLEAR(result);
                Py_XDECREF(exc_type); Py_XDECREF(exc_value); Py_XDECREF(exc_tb);
                PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
            }
        }
    }
    int inline_end = 0;
    if (fast_on(st)) {
        long depth = st->depth;
        if (data) inline_end = depth != 0;  /* a fetch ends no step while a phase is open */
        else if (depth > 1) inline_end = 1;  /* a nested backward */
        else if (depth == 1) inline_end = st->optimizers_seen;  /* a backward that cannot end a step */
    }
    if (inline_end) {
        st->depth--;
        int r;
        if (!data) {
            r = emit(st, END, TAG_PHASE, PH_BACKWARD, NULL, 0);
        } else if (n == NULL) {
            r = emit(st, END, TAG_DATA_NONE, result == NULL, NULL, 0);
        } else {
            long value = PyLong_AsLong(n);
            if (value == -1 && PyErr_Occurred()) {  /* no C long: the tuple itself */
                PyErr_Clear();
                PyObject *arg = PyTuple_Pack(2, self->phase, n);
                r = arg == NULL ? -1 : emit_obj(st, END, arg);
                Py_XDECREF(arg);
            } else {
                r = emit(st, END, TAG_DATA, 0, NULL, value);
            }
        }
        if (r < 0) report(inst);
    } else if (data) {
        PyObject *arg = PyTuple_Pack(2, self->phase, n != NULL ? n : result == NULL ? Py_False : Py_None);
        if (arg == NULL) report(inst);
        else {
            call_slow(inst, s_end, self->phase, arg, NULL);
            Py_DECREF(arg);
        }
    } else {
        call_slow(inst, s_end, self->phase, NULL, NULL);
    }
    Py_XDECREF(n);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return result;
}

static PyObject *Timed_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *orig, *inst, *bounds, *phase, *tensor_type;
    int kind;
    static char *names[] = {"orig", "inst", "bounds", "phase", "kind", "tensor_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOUiO", names, &orig, &inst, &bounds, &phase, &kind,
                                     &tensor_type))
        return NULL;
    if (kind != KIND_DATA && kind != KIND_BACKWARD) {
        PyErr_SetString(PyExc_ValueError, "kind must be DATA or BACKWARD");
        return NULL;
    }
    if (check_state(bounds) < 0) return NULL;
    Timed *self = (Timed *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = Timed_vectorcall;
    self->orig = Py_NewRef(orig);
    self->inst = Py_NewRef(inst);
    self->bounds = Py_NewRef(bounds);
    self->phase = Py_NewRef(phase);
    self->tensor_type = Py_NewRef(tensor_type);
    self->kind = kind;
    return (PyObject *)self;
}

static int Timed_traverse(Timed *self, visitproc visit, void *arg) {
    Py_VISIT(self->orig); Py_VISIT(self->inst); Py_VISIT(self->bounds); Py_VISIT(self->phase);
    Py_VISIT(self->tensor_type); Py_VISIT(self->dict);
    return 0;
}

static int Timed_clear(Timed *self) {
    Py_CLEAR(self->orig); Py_CLEAR(self->inst); Py_CLEAR(self->bounds); Py_CLEAR(self->phase);
    Py_CLEAR(self->tensor_type); Py_CLEAR(self->dict);
    return 0;
}

static void Timed_dealloc(Timed *self) {
    PyObject_GC_UnTrack(self);
    Timed_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* a method when set on a class (DataLoader iterators' __next__), a function when set on a module */
static PyObject *Timed_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyMemberDef Timed_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Timed, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Timed, vectorcall), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Timed_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
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
    PyObject *inst, *bounds, *known;
    int post;
} OptimizerHook;

/* opt is the loop's one optimizer (bounds.single), without making its id */
static int is_single(State *st, PyObject *opt) {
    PyObject *single = st->single;
    if (single == NULL || !PyLong_CheckExact(single)) return 0;
    void *p = PyLong_AsVoidPtr(single);
    if (p == NULL && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return p == (void *)opt;
}

static PyObject *OptimizerHook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    OptimizerHook *self = (OptimizerHook *)op;
    (void)kwnames;  /* a hook is called (optimizer, args, kwargs), positionally */
    PyObject *inst = self->inst;
    State *st = (State *)self->bounds;
    if (PyVectorcall_NARGS(nargsf) < 1) {
        PyErr_SetString(PyExc_TypeError, "an optimizer step hook takes (optimizer, args, kwargs)");
        return NULL;
    }
    PyObject *opt = args[0];
    int single = is_single(st, opt);
    PyObject *key = NULL;  /* id(opt), made only where needed */
    if (!self->post) {
        if (!single) {  /* an optimizer perfmon has not seen (made before instrument(), say) */
            key = PyLong_FromVoidPtr(opt);
            int known = key == NULL ? -1 : PySet_Contains(self->known, key);
            if (known < 0) report(inst);
            else if (!known) {
                PyObject *dyn = eager_begin();
                PyObject *r = PyObject_CallMethodOneArg(inst, s_note_optimizer, opt);
                eager_end(dyn);
                if (r == NULL) report(inst);
                else Py_DECREF(r);
            }
        }
        if (fast_on(st) && (st->depth || !st->pending)) {
            st->depth++;
            if (emit(st, BEGIN, TAG_PHASE, PH_OPTIMIZER, NULL, 0) < 0) report(inst);
        } else if (key != NULL || (key = PyLong_FromVoidPtr(opt)) != NULL) {
            call_slow(inst, s_begin, phase_names[PH_OPTIMIZER], Py_None, key);
        } else {
            report(inst);
        }
        /* step(closure): the closure's own work is timed apart (Instrumentation.wrap_closure), a rare case */
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        PyObject *a = nargs > 2 ? args[1] : NULL, *kw = nargs > 2 ? args[2] : NULL;
        PyObject *closure = NULL;  /* borrowed */
        if (a != NULL && PyTuple_Check(a) && PyTuple_GET_SIZE(a) > 1 && PyTuple_GET_ITEM(a, 1) != Py_None) {
            closure = PyTuple_GET_ITEM(a, 1);
        } else if (kw != NULL && PyDict_Check(kw) && PyDict_GET_SIZE(kw) > 0) {
            closure = PyDict_GetItemWithError(kw, s_closure);
            if (closure == NULL && PyErr_Occurred()) PyErr_Clear();
        }
        if (closure != NULL && closure != Py_None) {  /* step(closure); step(None) and step(**others) go as they came */
            Py_XDECREF(key);
            PyObject *dyn = eager_begin();
            PyObject *r = PyObject_CallMethodObjArgs(inst, s_wrap_closure, a, kw, NULL);
            eager_end(dyn);
            if (r == NULL) { report(inst); Py_RETURN_NONE; }
            return r;
        }
    } else if (single && fast_on(st) && st->depth == 1 && !st->explicit_) {
        /* the loop's one optimizer, at top level: its step ends the training step (Boundaries.end's fast case) */
        st->depth = 0;
        if (emit(st, END_BOUNDARY, TAG_OPTIMIZER, 0, opt, 0) < 0) report(inst);
        if (st->discovering) {
            PyObject *dyn = eager_begin();
            PyObject *r = PyObject_CallMethodNoArgs(inst, s_finish_discovery);
            eager_end(dyn);
            if (r == NULL) report(inst);
            Py_XDECREF(r);
        }
        step_ended(st, inst);
    } else {
        key = PyLong_FromVoidPtr(opt);
        PyObject *arg = key == NULL ? NULL : PyTuple_Pack(2, phase_names[PH_OPTIMIZER], key);
        if (arg == NULL) report(inst);
        else {
            call_slow(inst, s_end, phase_names[PH_OPTIMIZER], arg, key);
            Py_DECREF(arg);
        }
    }
    Py_XDECREF(key);
    Py_RETURN_NONE;
}

static PyObject *OptimizerHook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *inst, *bounds, *known;
    int post;
    static char *names[] = {"inst", "bounds", "known", "post", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!p", names, &inst, &bounds, &PySet_Type, &known, &post))
        return NULL;
    if (check_state(bounds) < 0) return NULL;
    OptimizerHook *self = (OptimizerHook *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = OptimizerHook_vectorcall;
    self->inst = Py_NewRef(inst);
    self->bounds = Py_NewRef(bounds);
    self->known = Py_NewRef(known);
    self->post = post;
    return (PyObject *)self;
}

static int OptimizerHook_traverse(OptimizerHook *self, visitproc visit, void *arg) {
    Py_VISIT(self->inst); Py_VISIT(self->bounds); Py_VISIT(self->known);
    return 0;
}

static int OptimizerHook_clear(OptimizerHook *self) {
    Py_CLEAR(self->inst); Py_CLEAR(self->bounds); Py_CLEAR(self->known);
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
#define EVALGRAD 3  /* with grad, the module in eval mode: model.eval() without torch.no_grad() */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inst, *bounds, *roots, *grad_enabled;
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

/* orig(mod, *args, **kwargs) */
static PyObject *call_orig(PyObject *orig, PyObject *mod, PyObject *args, PyObject *kwargs) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *kw = kwargs != Py_None ? kwargs : NULL;
    if (n < 8) {  /* on the stack, no tuple made */
        PyObject *stack[8];
        stack[0] = mod;
        for (Py_ssize_t i = 0; i < n; i++) stack[i + 1] = PyTuple_GET_ITEM(args, i);
        return PyObject_VectorcallDict(orig, stack, (size_t)(n + 1), kw);
    }
    PyObject *full = PyTuple_New(n + 1);
    if (full == NULL) return NULL;
    PyTuple_SET_ITEM(full, 0, Py_NewRef(mod));
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *r = PyObject_Call(orig, full, kw);
    Py_DECREF(full);
    return r;
}

static PyObject *Forward_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Forward *self = (Forward *)op;
    PyObject *inst = self->inst;
    State *st = (State *)self->bounds;
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL || !PyTuple_Check(args[2])
        || (args[3] != Py_None && !PyDict_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError, "forward(orig, module, args: tuple, kwargs: dict | None)");
        return NULL;
    }
    PyObject *orig = args[0], *mod = args[1];
    if (st->in_root || st->in_data || st->in_backward) return call_orig(orig, mod, args[2], args[3]);
    if (st->train_thread != 0 && st->train_thread != PyThread_get_thread_ident())  /* not the training thread */
        return call_orig(orig, mod, args[2], args[3]);
    if (st->discovering) {  /* discovery again: an instance of a root's class may be a new model (the next trial's) */
        PyObject *dyn = eager_begin();
        PyObject *r = PyObject_CallMethodOneArg(inst, s_root_class_call, mod);
        eager_end(dyn);
        if (r == NULL) report(inst);
        Py_XDECREF(r);
    }

    /* begin */
    PyObject *grad = PyObject_CallNoArgs(self->grad_enabled);
    int is_grad = grad == NULL ? -1 : PyObject_IsTrue(grad);
    Py_XDECREF(grad);
    int kind = GRAD;
    if (is_grad == 1) {  /* an evaluation that forgot torch.no_grad(): the module's own training flag says so */
        PyObject *training = PyObject_GetAttr(mod, s_training);
        if (training == NULL) PyErr_Clear();  /* a module without one: as with grad */
        else {
            if (training == Py_False) kind = EVALGRAD;
            Py_DECREF(training);
        }
    }
    if (is_grad == 0) {  /* another instance of the model's class: a copy (EMA) or a sibling */
        PyObject *key = PyLong_FromVoidPtr(mod);
        PyObject *ref = key == NULL ? NULL : PyDict_GetItemWithError(self->roots, key);
        Py_XDECREF(key);
        if (ref == NULL && PyErr_Occurred()) is_grad = -1;
        kind = ref != NULL && PyWeakref_Check(ref) && weakref_is(ref, mod) ? NOGRAD : COPY;
    }
    if (is_grad < 0) {  /* perfmon's own failure: the call goes on untimed */
        report(inst);
        return call_orig(orig, mod, args[2], args[3]);
    }
    if (fast_on(st) && (st->depth || !st->pending)) {
        st->depth++;
        if (emit(st, BEGIN, TAG_FORWARD, kind, mod, 0) < 0) report(inst);
    } else {
        PyObject *begin_arg = make_arg(TAG_FORWARD, kind, mod, 0);
        PyObject *kind_obj = begin_arg == NULL ? NULL : Py_NewRef(PyTuple_GET_ITEM(begin_arg, 2));
        if (begin_arg == NULL) {
            report(inst);
            return call_orig(orig, mod, args[2], args[3]);
        }
        call_slow(inst, s_begin, phase_names[PH_FORWARD], begin_arg, kind_obj);
        Py_DECREF(begin_arg); Py_DECREF(kind_obj);
    }
    st->in_root++;

    PyObject *result = call_orig(orig, mod, args[2], args[3]);

    /* end, whatever the call did */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    st->in_root--;
    if (fast_on(st) && st->depth) {  /* a forward ends no step while a phase is open */
        st->depth--;
        if (emit(st, END, TAG_PHASE, PH_FORWARD, NULL, 0) < 0) report(inst);
    } else {
        call_slow(inst, s_end, phase_names[PH_FORWARD], NULL, NULL);
    }
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return result;
}

static PyObject *Forward_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *inst, *bounds, *roots, *grad_enabled;
    static char *names[] = {"inst", "bounds", "roots", "grad_enabled", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O", names, &inst, &bounds, &PyDict_Type, &roots,
                                     &grad_enabled))
        return NULL;
    if (check_state(bounds) < 0) return NULL;
    Forward *self = (Forward *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = Forward_vectorcall;
    self->inst = Py_NewRef(inst);
    self->bounds = Py_NewRef(bounds);
    self->roots = Py_NewRef(roots);
    self->grad_enabled = Py_NewRef(grad_enabled);
    return (PyObject *)self;
}

static int Forward_traverse(Forward *self, visitproc visit, void *arg) {
    Py_VISIT(self->inst); Py_VISIT(self->bounds); Py_VISIT(self->roots); Py_VISIT(self->grad_enabled);
    return 0;
}

static int Forward_clear(Forward *self) {
    Py_CLEAR(self->inst); Py_CLEAR(self->bounds); Py_CLEAR(self->roots); Py_CLEAR(self->grad_enabled);
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

/* -- step rows: the agent's publisher formats every step of the recording -------------------------------- */

static PyObject *s_index, *s_start, *s_phases,  /* and s_end, the hooks' */
    *s_samples, *k_data, *k_forward, *k_backward, *k_optimizer;

static int attr_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int item_double(PyObject *dict, PyObject *key, double *out) {
    PyObject *v = PyDict_GetItemWithError(dict, key);  /* borrowed */
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    *out = PyFloat_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* -- SteadyStep: a step the tracker's fast path made of a STEADY event ---------------------------------------- */

/* What steps.StepRecord says of a step, for the steps of a steady loop: the times as doubles, made without a
 * Python frame, a dict or nine float objects a step (the publisher makes one per step at any step rate). Reads as a
 * StepRecord: index, start, end, phases (a new dict), samples (None for none), marks (empty), closures (0), prefetch (0.0), duration,
 * other; step_rows reads its fields directly. */
typedef struct {
    PyObject_HEAD
    long long index, samples;
    double start, end, data, forward, backward, optimizer;
} SteadyStep;

static PyTypeObject SteadyStepType;
static PyObject *no_marks;  /* steps.NO_MARKS: set by steady_steps' caller */

static PyObject *SteadyStep_phases(SteadyStep *self, void *c) {
    (void)c;
    PyObject *d = PyDict_New();
    double v[4] = {self->data, self->forward, self->backward, self->optimizer};
    for (int q = 0; d != NULL && q < 4; q++) {
        PyObject *f = PyFloat_FromDouble(v[q]);
        if (f == NULL || PyDict_SetItem(d, phase_names[q], f) < 0) Py_CLEAR(d);
        Py_XDECREF(f);
    }
    return d;
}

static PyObject *SteadyStep_samples(SteadyStep *self, void *c) {
    (void)c;
    return self->samples ? PyLong_FromLongLong(self->samples) : Py_NewRef(Py_None);
}

static PyObject *SteadyStep_marks(SteadyStep *self, void *c) {
    (void)self; (void)c;
    return no_marks != NULL ? Py_NewRef(no_marks) : PyDict_New();
}

static PyObject *SteadyStep_closures(SteadyStep *self, void *c) { (void)self; (void)c; return Py_NewRef(zero); }

static PyObject *SteadyStep_prefetch(SteadyStep *self, void *c) { (void)self; (void)c; return PyFloat_FromDouble(0.0); }

static PyObject *SteadyStep_duration(SteadyStep *self, void *c) {
    (void)c;
    return PyFloat_FromDouble(self->end - self->start);
}

static PyObject *SteadyStep_other(SteadyStep *self, void *c) {
    (void)c;
    /* StepRecord.other: max(0.0, duration - sum(phases.values())), summed in the dict's order */
    double other = (self->end - self->start) - (((0.0 + self->data) + self->forward + self->backward) + self->optimizer);
    return PyFloat_FromDouble(other > 0.0 ? other : 0.0);
}

static PyObject *SteadyStep_repr(SteadyStep *self) {
    char text[256];
    snprintf(text, sizeof text, "SteadyStep(index=%lld, start=%.17g, end=%.17g, data=%.17g, forward=%.17g, "
             "backward=%.17g, optimizer=%.17g, samples=%lld)", self->index, self->start, self->end, self->data, self->forward,
             self->backward, self->optimizer, self->samples);
    return PyUnicode_FromString(text);
}

static const char *const record_fields[] = {"index", "start", "end", "phases", "samples", "marks", "closures",
                                             "prefetch"};

/* (index, start, end, phases, samples, marks, closures, prefetch) of a step, read as attributes; NULL with
 * AttributeError cleared (and NotImplemented the answer) where `obj` is not a step */
static PyObject *record_tuple(PyObject *obj) {
    PyObject *t = PyTuple_New(8);
    for (int q = 0; t != NULL && q < 8; q++) {
        PyObject *v = PyObject_GetAttrString(obj, record_fields[q]);
        if (v == NULL) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, q, v);
    }
    return t;
}

/* Equal to a StepRecord (or a SteadyStep) of the same fields: what feeding the events one by one makes. */
static PyObject *SteadyStep_richcompare(PyObject *self, PyObject *other, int op) {
    if (op != Py_EQ && op != Py_NE) Py_RETURN_NOTIMPLEMENTED;
    PyObject *mine = record_tuple(self), *theirs = mine == NULL ? NULL : record_tuple(other);
    PyObject *result = NULL;
    if (theirs != NULL) {
        result = PyObject_RichCompare(mine, theirs, op);
    } else if (mine != NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        result = Py_NewRef(Py_NotImplemented);
    }
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
    return result;
}

static PyMemberDef SteadyStep_members[] = {
    {"index", T_LONGLONG, offsetof(SteadyStep, index), READONLY, NULL},
    {"start", T_DOUBLE, offsetof(SteadyStep, start), READONLY, NULL},
    {"end", T_DOUBLE, offsetof(SteadyStep, end), READONLY, NULL},
    {NULL},
};

static PyGetSetDef SteadyStep_getset[] = {
    {"phases", (getter)SteadyStep_phases, NULL, NULL, NULL},
    {"samples", (getter)SteadyStep_samples, NULL, NULL, NULL},
    {"marks", (getter)SteadyStep_marks, NULL, NULL, NULL},
    {"closures", (getter)SteadyStep_closures, NULL, NULL, NULL},
    {"prefetch", (getter)SteadyStep_prefetch, NULL, NULL, NULL},
    {"duration", (getter)SteadyStep_duration, NULL, NULL, NULL},
    {"other", (getter)SteadyStep_other, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject SteadyStepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfmon.agent._hot.SteadyStep",
    .tp_basicsize = sizeof(SteadyStep),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A step of a steady loop, as the tracker's fast path makes it in C (reads as a steps.StepRecord).",
    .tp_repr = (reprfunc)SteadyStep_repr,
    .tp_richcompare = SteadyStep_richcompare,
    .tp_hash = PyObject_HashNotImplemented,  /* like StepRecord (a dataclass with eq) */
    .tp_members = SteadyStep_members,
    .tp_getset = SteadyStep_getset,
};

static inline int exact_float(PyObject *o, double *out) {
    if (!PyFloat_CheckExact(o)) return 0;
    *out = PyFloat_AS_DOUBLE(o);
    return 1;
}

/* steady_steps(events, i, count, start, trained, out, no_marks) -> (i, count, start): StepTracker._steady's STEADY
 * case in C. From events[i] on, each STEADY event (a steady iteration the ring folded) becomes a SteadyStep
 * appended to `out` (its model key added to the set `trained`), numbered from count + 1, the first starting at
 * `start`, each next one where the last ended. Stops at the first other event (or one it cannot read: the
 * Python path takes it); returns where it stopped, the last index and the last end. */
static PyObject *steady_steps(PyObject *m, PyObject *args) {
    PyObject *events, *trained, *out, *marks;
    Py_ssize_t i;
    long long count;
    double start;
    (void)m;
    if (!PyArg_ParseTuple(args, "O!nLdO!O!O", &PyList_Type, &events, &i, &count, &start, &PySet_Type, &trained,
                          &PyList_Type, &out, &marks))
        return NULL;
    if (no_marks == NULL) no_marks = Py_NewRef(marks);
    Py_ssize_t n = PyList_GET_SIZE(events);
    PyObject *last_key = NULL;
    for (; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (!PyTuple_CheckExact(ev) || PyTuple_GET_SIZE(ev) != 4 || PyTuple_GET_ITEM(ev, 0) != codes[STEADY]
            || PyTuple_GET_ITEM(ev, 3) != Py_None)
            break;
        PyObject *a = PyTuple_GET_ITEM(ev, 2);
        double t_end, t_fetch = 0.0, t_fetched = 0.0, t2, t3, t4, t5, t6;
        if (!PyTuple_CheckExact(a) || PyTuple_GET_SIZE(a) != 10 || !exact_float(PyTuple_GET_ITEM(ev, 1), &t_end))
            break;
        PyObject *fetch = PyTuple_GET_ITEM(a, 0), *fetched = PyTuple_GET_ITEM(a, 1), *nsamples = PyTuple_GET_ITEM(a, 2);
        int fetches = fetch != Py_None;
        if ((fetches && !(exact_float(fetch, &t_fetch) && exact_float(fetched, &t_fetched)))
            || !exact_float(PyTuple_GET_ITEM(a, 3), &t2) || !exact_float(PyTuple_GET_ITEM(a, 5), &t3)
            || !exact_float(PyTuple_GET_ITEM(a, 6), &t4) || !exact_float(PyTuple_GET_ITEM(a, 7), &t5)
            || !exact_float(PyTuple_GET_ITEM(a, 8), &t6) || (nsamples != Py_None && !PyLong_CheckExact(nsamples)))
            break;
        long long samples = nsamples == Py_None ? 0 : PyLong_AsLongLong(nsamples);
        if (samples == -1 && PyErr_Occurred()) return NULL;
        PyObject *key = PyTuple_GET_ITEM(a, 4);
        if (key != last_key) {
            if (PySet_Add(trained, key) < 0) return NULL;
            last_key = key;
        }
        SteadyStep *rec = PyObject_New(SteadyStep, &SteadyStepType);
        if (rec == NULL) return NULL;
        rec->index = ++count;
        rec->start = start;
        rec->end = t_end;
        rec->data = fetches ? t_fetched - t_fetch : 0.0;
        rec->forward = t3 - t2;
        rec->backward = t5 - t4;
        rec->optimizer = t_end - t6;
        rec->samples = samples;
        int failed = PyList_Append(out, (PyObject *)rec);
        Py_DECREF(rec);
        if (failed < 0) return NULL;
        start = t_end;
    }
    return Py_BuildValue("(nLd)", i, count, start);
}

/* -- numbers as text ------------------------------------------------------------------------------- */

/* The digits of n, most significant first, at p; at least `width` of them (zero-padded). Returns the count. */
static int put_digits(char *p, unsigned long long n, int width) {
    char tmp[24];
    int k = 0;
    do { tmp[k++] = (char)('0' + n % 10); n /= 10; } while (n);
    while (k < width) tmp[k++] = '0';
    for (int i = 0; i < k; i++) p[i] = tmp[k - 1 - i];
    return k;
}

/* printf's "%lld". */
static int put_int(char *p, long long v) {
    if (v < 0) {
        *p = '-';
        return 1 + put_digits(p + 1, (unsigned long long)0 - (unsigned long long)v, 1);
    }
    return put_digits(p, (unsigned long long)v, 1);
}

/* The room put_fixed may need: printf's "%.9f" of -DBL_MAX is 320 characters. */
#define FIXED_MAX 400

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9};
static const unsigned long long IPOW10[] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000,
                                            1000000000};

/* printf's (and Python's) "%.<prec>f" of x, 0 <= prec <= 9: the exact decimal value of the double rounded half to
 * even, written without printf's multiprecision path (~200 ns a number; a step row has nine). x * 10^prec is
 * split into its rounded double y and the exact remainder err = fma(x, 10^prec, -y), so the exact product is
 * y + err and which way it rounds is decided exactly: by the sign of frac(y) - 1/2 (exact, and a nonzero value
 * is at least one ulp of y, larger than |err|), and on an exact half of y by the sign of err, an exact tie going
 * to the even neighbour. Beyond 2^52 (and for NaN and infinities) it is printf's. Returns the length. */
static int put_fixed(char *p, double x, int prec) {
    double a = fabs(x), scale = POW10[prec];
    double y = a * scale;
    if (isnan(x)) { memcpy(p, "nan", 3); return 3; }  /* Python's word: glibc says "-nan" for some */
    if (!(y < 4503599627370496.0)) return snprintf(p, FIXED_MAX, "%.*f", prec, x);  /* 2^52, and infinities */
    double err = fma(a, scale, -y);
    double r = floor(y);
    double g = (y - r) - 0.5;
    unsigned long long n = (unsigned long long)r;
    if (g != 0.0) n += g > 0.0;
    else if (err != 0.0) n += err > 0.0;
    else n += n & 1;
    int k = 0;
    if (signbit(x)) p[k++] = '-';  /* "-0.0000" for -0.0 and for what rounds to it, as printf and Python say */
    k += put_digits(p + k, n / IPOW10[prec], 1);
    if (prec > 0) {
        p[k++] = '.';
        k += put_digits(p + k, n % IPOW10[prec], prec);
    }
    return k;
}

static PyObject *format_fixed(PyObject *m, PyObject *args) {
    double x;
    int prec;
    (void)m;
    if (!PyArg_ParseTuple(args, "di", &x, &prec)) return NULL;
    if (prec < 0 || prec > 9) {
        PyErr_SetString(PyExc_ValueError, "precision must be 0 to 9");
        return NULL;
    }
    char text[FIXED_MAX];
    return PyUnicode_FromStringAndSize(text, put_fixed(text, x, prec));
}

/* step_rows(records, off, cut) -> (rows, bulk): the JSON text of each step row (protocol.STEP_FIELDS; records are
 * (StepRecord, device ms) pairs without closures or device times), and for the first `cut` rows the sums a bulk
 * summary needs: (first_i, last_i, first_start, last_t, max_ms, dur, data, forward, backward, optimizer, other,
 * samples, samples_steps), or None when cut is 0. The same numbers and text as runtime.Agent._publish_steps makes
 * in Python (tests/test_hot_path.py compares the two). */
static PyObject *step_rows(PyObject *m, PyObject *args) {
    PyObject *records;
    double off;
    Py_ssize_t cut;
    (void)m;
    if (!PyArg_ParseTuple(args, "O!dn", &PyList_Type, &records, &off, &cut)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records);
    PyObject *rows = PyList_New(n);
    if (rows == NULL) return NULL;
    long long first_i = 0, last_i = 0, samples_sum = 0, samples_steps = 0;
    double first_start = 0.0, last_t = 0.0, max_ms = 0.0, sums[6] = {0, 0, 0, 0, 0, 0};
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PyList_GET_ITEM(records, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) < 1) {
            PyErr_SetString(PyExc_TypeError, "records are (StepRecord, device ms) pairs");
            goto fail;
        }
        PyObject *rec = PyTuple_GET_ITEM(pair, 0);
        double start, end, d, f, b, o;
        long long index, samples = 0;
        if (Py_IS_TYPE(rec, &SteadyStepType)) {  /* the fast path's steps: no attribute lookups */
            SteadyStep *st = (SteadyStep *)rec;
            start = st->start; end = st->end; d = st->data; f = st->forward; b = st->backward; o = st->optimizer;
            index = st->index;
            samples = st->samples;
        } else {
            PyObject *phases = PyObject_GetAttr(rec, s_phases);
            if (phases == NULL) goto fail;
            int bad = !PyDict_Check(phases) || attr_double(rec, s_start, &start) < 0
                      || attr_double(rec, s_end, &end) < 0 || item_double(phases, k_data, &d) < 0
                      || item_double(phases, k_forward, &f) < 0 || item_double(phases, k_backward, &b) < 0
                      || item_double(phases, k_optimizer, &o) < 0;
            Py_DECREF(phases);
            if (bad) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a step's phases must be a dict");
                goto fail;
            }
            PyObject *v = PyObject_GetAttr(rec, s_index);
            index = v == NULL ? -1 : PyLong_AsLongLong(v);
            Py_XDECREF(v);
            if (index == -1 && PyErr_Occurred()) goto fail;
            v = PyObject_GetAttr(rec, s_samples);
            if (v == NULL) goto fail;
            if (v != Py_None) {
                int truth = PyObject_IsTrue(v);
                samples = truth > 0 ? PyLong_AsLongLong(v) : 0;
                if (truth < 0 || (samples == -1 && PyErr_Occurred())) { Py_DECREF(v); goto fail; }
            }
            Py_DECREF(v);
        }
        double dur = end - start;
        double other = dur - d - f - b - o;
        double t = end + off, dur_ms = dur * 1e3;
        double cols[6] = {dur_ms, d * 1e3, f * 1e3, b * 1e3, o * 1e3, other > 0.0 ? other * 1e3 : 0.0};
        /* "[%lld,%.6f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%lld]"; put_fixed needs FIXED_MAX free at most, so the buffer
         * holds any row */
        char text[8 * FIXED_MAX + 64];
        int len = 0;
        text[len++] = '[';
        len += put_int(text + len, index);
        text[len++] = ',';
        len += put_fixed(text + len, t, 6);
        for (int q = 0; q < 6; q++) {
            text[len++] = ',';
            len += put_fixed(text + len, cols[q], 4);
        }
        text[len++] = ',';
        len += put_int(text + len, samples);
        text[len++] = ']';
        PyObject *str = PyUnicode_FromStringAndSize(text, len);
        if (str == NULL) goto fail;
        PyList_SET_ITEM(rows, k, str);
        if (k < cut) {
            if (k == 0) { first_i = index; first_start = t - dur_ms / 1e3; max_ms = dur_ms; }
            last_i = index;
            last_t = t;
            if (dur_ms > max_ms) max_ms = dur_ms;
            for (int q = 0; q < 6; q++) sums[q] += cols[q];
            samples_sum += samples;
            samples_steps += samples != 0;
        }
    }
    if (cut <= 0 || n == 0) return Py_BuildValue("(NO)", rows, Py_None);
    return Py_BuildValue("(N(LLdddddddddLL))", rows, first_i, last_i, first_start, last_t, max_ms, sums[0], sums[1],
                         sums[2], sums[3], sums[4], sums[5], samples_sum, samples_steps);
fail:
    Py_DECREF(rows);
    return NULL;
}

/* -- module --------------------------------------------------------------------------------------- */

static PyObject *hot_clock(PyObject *m, PyObject *Py_UNUSED(ignored)) { (void)m; return PyFloat_FromDouble(now()); }

/* run_rank(start, finish, fn, i, *args): start(i) -> token; fn(i, *args), its result or its exception passed on as
 * they are; finish(token, the exception or None) in between. In C, so that a rank's traceback has no frame of
 * perfmon's between torch's spawn wrapper and the script's function. start's and finish's errors are dropped
 * (each catches its own: the rank runs regardless), but for a KeyboardInterrupt or SystemExit, which go up as
 * they would from Python: start's before fn runs, finish's in place of fn's result. */
static int only_an_exception(void) {
    return PyErr_ExceptionMatches(PyExc_Exception);
}

static PyObject *run_rank(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    if (nargs < 4) {
        PyErr_SetString(PyExc_TypeError, "run_rank(start, finish, fn, i, *args)");
        return NULL;
    }
    PyObject *token = PyObject_CallOneArg(args[0], args[3]);
    if (token == NULL) {
        if (!only_an_exception()) return NULL;
        PyErr_Clear();
        token = Py_NewRef(Py_None);
    }
    PyObject *result = PyObject_Vectorcall(args[2], args + 3, (size_t)(nargs - 3), NULL);
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (result == NULL) {
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    }
    PyObject *r = PyObject_CallFunctionObjArgs(args[1], token, value != NULL ? value : Py_None, NULL);
    Py_DECREF(token);
    if (r == NULL) {
        if (result != NULL && !only_an_exception()) {  /* a Ctrl-C as the rank ended: it goes up */
            Py_DECREF(result);
            return NULL;
        }
        PyErr_Clear();
    }
    Py_XDECREF(r);
    if (result == NULL) PyErr_Restore(type, value, tb);
    return result;
}

static PyMethodDef hot_methods[] = {
    {"clock", hot_clock, METH_NOARGS, "The hooks' clock: time.perf_counter()'s, read as the C hooks read it."},
    {"run_rank", (PyCFunction)(void (*)(void))run_rank, METH_FASTCALL,
     "run_rank(start, finish, fn, i, *args): fn(i, *args) between start(i) and finish(token, exception or None)."},
    {"step_rows", step_rows, METH_VARARGS, "step_rows(records, off, cut) -> (rows, bulk sums or None)."},
    {"format_fixed", format_fixed, METH_VARARGS, "format_fixed(x, prec) -> '%.<prec>f' % x, as step_rows writes it."},
    {"steady_steps", steady_steps, METH_VARARGS,
     "steady_steps(events, i, count, start, trained, out, no_marks) -> (i, count, start): the fast path's STEADY steps."},
    {NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "perfmon.agent._hot",
    "perfmon's hook hot path in C (optional; hooks.py has the same hooks in Python).", -1, hot_methods,
    NULL, NULL, NULL, NULL,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__hot(void) {
    INTERN(s_on_error, "_on_error"); INTERN(s_hooks, "hooks"); INTERN(s_begin, "begin"); INTERN(s_end, "end");
    INTERN(s_finish_discovery, "finish_discovery"); INTERN(s_boundary, "_boundary");
    INTERN(s_note_optimizer, "_note_optimizer"); INTERN(s_root_class_call, "_root_class_call");
    INTERN(s_wrap_closure, "wrap_closure"); INTERN(s_closure, "closure"); INTERN(s_emit, "_emit"); INTERN(s_size, "size"); INTERN(s_values, "values");
    INTERN(s_key, "key"); INTERN(s_after_count, "after_count"); INTERN(s_training, "training");
    INTERN(s_index, "index"); INTERN(s_start, "start"); INTERN(s_phases, "phases");
    INTERN(s_samples, "samples"); INTERN(k_data, "data"); INTERN(k_forward, "forward");
    INTERN(k_backward, "backward"); INTERN(k_optimizer, "optimizer");
    INTERN(phase_names[PH_DATA], "data"); INTERN(phase_names[PH_FORWARD], "forward");
    INTERN(phase_names[PH_BACKWARD], "backward"); INTERN(phase_names[PH_OPTIMIZER], "optimizer");
    if ((kw_key = PyTuple_Pack(1, s_key)) == NULL || (zero = PyLong_FromLong(0)) == NULL) return NULL;
    for (int i = 0; i < 8; i++)
        if ((codes[i] = PyLong_FromLong(i)) == NULL) return NULL;
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&StateType) < 0 || PyType_Ready(&CommandStateType) < 0
        || PyType_Ready(&TimedType) < 0 || PyType_Ready(&OptimizerHookType) < 0 || PyType_Ready(&ForwardType) < 0
        || PyType_Ready(&SteadyStepType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hot_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0
        || PyModule_AddObjectRef(m, "State", (PyObject *)&StateType) < 0
        || PyModule_AddObjectRef(m, "CommandState", (PyObject *)&CommandStateType) < 0
        || PyModule_AddObjectRef(m, "Timed", (PyObject *)&TimedType) < 0
        || PyModule_AddObjectRef(m, "OptimizerHook", (PyObject *)&OptimizerHookType) < 0
        || PyModule_AddObjectRef(m, "Forward", (PyObject *)&ForwardType) < 0
        || PyModule_AddObjectRef(m, "SteadyStep", (PyObject *)&SteadyStepType) < 0
        || PyModule_AddIntConstant(m, "DATA", KIND_DATA) < 0
        || PyModule_AddIntConstant(m, "BACKWARD", KIND_BACKWARD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
