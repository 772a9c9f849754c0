/* unison._coll: a small allreduce's shared-memory steps in C (issue 9).
 *
 * collective/shm.py owns the segment's layout, the protocol and every slow path; this file
 * runs the steps a small allreduce pays each time, in one call and without the interpreter:
 *
 *   small(): take the collective's generation as shm.py's _next does (its _index and _owe
 *            lists), where nothing is owed that _next would wait for or raise on (else
 *            PASS, with nothing done), then
 *   stage 0: nbytes and signature into our record, our input into our slot, what we call
 *            (descriptor, 0) at the parity's place; release-store our generation; wait a
 *            short while for every peer to reach it.
 *   stage 1: (the peers met) check every peer's descriptor, nbytes and signature; reduce
 *            the slots in rank order into out; release-store generation | 1; wait a short
 *            while for every peer to reach it.
 *
 * The waits here are short (the caller's budget, 0 on a crowded machine): a yield-spin
 * that gives up after the budget, after one yield that kept us off the core longer than
 * long_ns, or when the controller's abort flag is up. The caller then waits with its own
 * Pacer, which checks for dead, departed and out-of-step peers and raises; each return
 * says where it stopped:
 *
 *   DONE 0        out holds the result and every peer passed generation | 1
 *   MEET 1        published and arrived; some peer has not: wait for gen, then stage 1
 *   MISMATCH 2    some peer called something else or passed other data: the caller raises
 *   DEPART 3      out holds the result; some peer has not passed generation | 1 yet
 *   PASS 4        (small) nothing done: the caller settles what is owed, or copies a, first
 *   FULL 5        (small) nothing done: the generation would not fit its word (the index
 *                 or the call id past its bits); the caller raises
 *   | LONG 16     a yield took longer than long_ns (the machine may be crowded)
 *
 * And end(call_id), which the worker loop calls after every call (most run no collective):
 * our "left" word, then the owner's _tidy() only where it holds spills or pidfds. As a
 * Python method it cost a tenth of a worker's instructions per call (issue 9, seventeenth
 * pass).
 *
 * Reductions run element by element in rank order, (x0 op x1) op x2 ..., as collective/
 * shm.py's numpy path does, so every rank computes the same bits whichever path it takes
 * (integers wrap as numpy's do; no float min or max: numpy's NaN rules stay numpy's).
 * Compiled with -ffp-contract=off: nothing may fuse a product into a sum.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* The start of this file's sha256, set by setup.py; unison._native refuses a module whose
   SOURCE differs from the file beside it (a stale build). */
#ifndef UNISON_SOURCE
#define UNISON_SOURCE ""
#endif

/* words of a worker's record, as collective/shm.py's _GEN_W .. _DESC (checked at import) */
enum { GEN_W, GEN_G, LEFT, PID, NBYTES, SIG, DESC };
enum { DONE = 0, MEET = 1, MISMATCH = 2, DEPART = 3, PASS = 4, FULL = 5, LONG = 16 };
/* a generation: call << CALL_SHIFT | index << 2 | phase, as shm.py's _CALL_SHIFT, _MAX_INDEX
   and _MAX_CALL (checked at import): at most MAX_INDEX collectives per call and scope, call
   ids below MAX_CALL */
#define CALL_SHIFT 26
#define MAX_INDEX (1LL << (CALL_SHIFT - 2))
#define MAX_CALL (1ULL << (64 - CALL_SHIFT))
/* what reduces how: (op << 4) | type */
enum { T_F32, T_F64, T_I32, T_I64, T_U32, T_U64 };
enum { OP_SUM, OP_PROD, OP_MIN, OP_MAX };
#define MAX_RANKS 256
#define UNLOCKED (1 << 20) /* copies and folds this large run without the GIL, as numpy's do */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *q;
    char *base;
    int n, rank;
    Py_ssize_t rec[MAX_RANKS];  /* word index of each rank's record */
    Py_ssize_t slot[MAX_RANKS]; /* byte offset of each rank's slot */
    Py_ssize_t slot_size;
    PyObject *owner;          /* a weak reference to the ShmCollectives, or NULL */
    PyObject *spills, *pidfds; /* the owner's dicts: end() calls its _tidy() while either holds */
    PyObject *index, *owe;     /* the owner's lists: small() takes a generation as _next does */
    uint64_t last_gen;         /* small()'s last generation, for the caller that finishes it */
} Reducer;

static inline uint64_t load(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

#if defined(__x86_64__) || defined(__i386__)
static inline void cpu_relax(void) { __builtin_ia32_pause(); }
#else
static inline void cpu_relax(void) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
#endif

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void Reducer_dealloc(Reducer *self) {
    if (self->view.obj) PyBuffer_Release(&self->view);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->spills);
    Py_CLEAR(self->pidfds);
    Py_CLEAR(self->index);
    Py_CLEAR(self->owe);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Every use checks this first: after release() it raises, never touches the mapping. */
static int released(Reducer *self) {
    if (self->q) return 0;
    PyErr_SetString(PyExc_ValueError, "the collectives were closed (their session was "
                    "closed): open a new Session to go on");
    return 1;
}

/* release(): let go of the mapping now, so that its owner can unmap it whoever still holds
 * this object (a frame of a traceback user code kept, in worker 0 inline) */
static PyObject *Reducer_release(Reducer *self, PyObject *unused) {
    (void)unused;
    if (self->view.obj) PyBuffer_Release(&self->view);
    self->q = NULL;
    self->base = NULL;
    Py_RETURN_NONE;
}

static int Reducer_init(Reducer *self, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *buf, *recs, *slots, *owner = NULL;
    Py_ssize_t slot_size;
    int rank;
    if (!PyArg_ParseTuple(args, "OiOOn|O", &buf, &rank, &recs, &slots, &slot_size, &owner))
        return -1;
    Py_CLEAR(self->owner);
    Py_CLEAR(self->spills);
    Py_CLEAR(self->pidfds);
    Py_CLEAR(self->index);
    Py_CLEAR(self->owe);
    if (owner) {  /* no strong reference: the owner holds this object */
        self->owner = PyWeakref_NewRef(owner, NULL);
        self->spills = self->owner ? PyObject_GetAttrString(owner, "_spills") : NULL;
        self->pidfds = self->spills ? PyObject_GetAttrString(owner, "_pidfds") : NULL;
        self->index = self->pidfds ? PyObject_GetAttrString(owner, "_index") : NULL;
        self->owe = self->index ? PyObject_GetAttrString(owner, "_owe") : NULL;
        if (!self->owe) return -1;
        if (!PyDict_CheckExact(self->spills) || !PyDict_CheckExact(self->pidfds)) {
            PyErr_SetString(PyExc_TypeError, "owner: its _spills and _pidfds must be dicts");
            return -1;
        }
        if (!PyList_CheckExact(self->index) || PyList_GET_SIZE(self->index) != 2 ||
            !PyList_CheckExact(self->owe) || PyList_GET_SIZE(self->owe) != 2) {
            PyErr_SetString(PyExc_TypeError, "owner: its _index and _owe must be lists of 2");
            return -1;
        }
    }
    Py_ssize_t n = PySequence_Size(recs);
    if (n < 1 || n > MAX_RANKS || PySequence_Size(slots) != n) {
        PyErr_SetString(PyExc_ValueError, "records and slots: one per rank, at most 256");
        return -1;
    }
    if (self->view.obj) PyBuffer_Release(&self->view);
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->q = (uint64_t *)self->view.buf;
    self->base = (char *)self->view.buf;
    if (rank < 0 || rank >= n) {
        PyErr_SetString(PyExc_ValueError, "rank: one of the records");
        return -1;
    }
    self->n = (int)n;
    self->rank = rank;
    self->slot_size = slot_size;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PySequence_GetItem(recs, i), *s = PySequence_GetItem(slots, i);
        if (!r || !s) { Py_XDECREF(r); Py_XDECREF(s); return -1; }
        self->rec[i] = PyLong_AsSsize_t(r);
        self->slot[i] = PyLong_AsSsize_t(s);
        Py_DECREF(r); Py_DECREF(s);
        if (PyErr_Occurred()) return -1;
        if (self->rec[i] < 0 || self->slot[i] < 0 ||
            (self->rec[i] + DESC + 8) * 8 > self->view.len ||
            self->slot[i] + slot_size > self->view.len) {
            PyErr_SetString(PyExc_ValueError, "a record or slot lies outside the buffer");
            return -1;
        }
    }
    return 0;
}

/* Whether every rank of ranks[0:m] shows a generation in [lo, hi) on counter which. */
static int reached(Reducer *s, const int *ranks, int m, int which, uint64_t lo, uint64_t hi) {
    for (int k = 0; k < m; k++) {
        uint64_t g = load(&s->q[s->rec[ranks[k]] + which]);
        if (g < lo || g >= hi) return 0;
    }
    return 1;
}

/* Spin until reached(): ``pauses`` checks a pause apart, then yield-spin for at most
 * budget_ns. 1 if reached; 0, and *long_seen when a yield kept us off the core longer than
 * long_ns, if not. */
typedef struct { int pauses; int64_t budget_ns, long_ns; } Spin;

static int await_short(Reducer *s, const int *ranks, int m, int which, uint64_t lo,
                       uint64_t hi, const Spin *spin, int *long_seen) {
    if (reached(s, ranks, m, which, lo, hi)) return 1;
    int64_t budget_ns = spin->budget_ns, long_ns = spin->long_ns;
    if (budget_ns <= 0) return 0;
    for (int i = 0; i < spin->pauses; i++) { /* a peer on another core is often this close */
        cpu_relax();
        if (reached(s, ranks, m, which, lo, hi)) return 1;
    }
    int64_t t = now_ns(), end = t + budget_ns;
    while (!load(&s->q[0])) { /* the controller's abort flag: the caller raises */
        sched_yield();
        int64_t after = now_ns();
        if (reached(s, ranks, m, which, lo, hi)) return 1;
        if (after - t > long_ns) { *long_seen = 1; return 0; }
        if (after >= end) return 0;
        t = after;
    }
    return 0;
}

#define FOLD(T, EXPR)                                                           \
    do {                                                                           \
        T *o = (T *)out;                                                           \
        const T *a = (const T *)parts[0], *b = (const T *)parts[1];                \
        for (Py_ssize_t i = 0; i < count; i++) { T x = a[i], y = b[i]; o[i] = (EXPR); } \
        for (int k = 2; k < m; k++) {                                              \
            b = (const T *)parts[k];                                               \
            for (Py_ssize_t i = 0; i < count; i++) { T x = o[i], y = b[i]; o[i] = (EXPR); } \
        }                                                                          \
    } while (0)

#define WRAPPING(U, OP) FOLD(U, (U)(x OP y)) /* unsigned: wraps as numpy's integers do */
#define ORDERED(T, CMP) FOLD(T, (y CMP x) ? y : x)

/* The item size of what ``code`` reduces; 0 if fold() does not take it. */
static int item_size(int code) {
    static const int size[] = {4, 8, 4, 8, 4, 8};
    int type = code & 15, op = code >> 4;
    if (code < 0 || type > T_U64 || op > OP_MAX) return 0;
    if ((type == T_F32 || type == T_F64) && op > OP_PROD) return 0; /* numpy's NaN rules */
    return size[type];
}

/* out = parts[0] op parts[1] op ... elementwise, in order; 0 if code is unknown. */
static int fold(int code, char *out, char *const *parts, int m, Py_ssize_t nbytes) {
    int size = item_size(code);
    if (!size) return 0;
    Py_ssize_t count = nbytes / size;
    if (m == 1) {
        memcpy(out, parts[0], (size_t)nbytes);
        return 1;
    }
    switch (code) {
    case OP_SUM << 4 | T_F32: FOLD(float, x + y); return 1;
    case OP_SUM << 4 | T_F64: FOLD(double, x + y); return 1;
    case OP_PROD << 4 | T_F32: FOLD(float, x * y); return 1;
    case OP_PROD << 4 | T_F64: FOLD(double, x * y); return 1;
    case OP_SUM << 4 | T_I32: case OP_SUM << 4 | T_U32: WRAPPING(uint32_t, +); return 1;
    case OP_SUM << 4 | T_I64: case OP_SUM << 4 | T_U64: WRAPPING(uint64_t, +); return 1;
    case OP_PROD << 4 | T_I32: case OP_PROD << 4 | T_U32: WRAPPING(uint32_t, *); return 1;
    case OP_PROD << 4 | T_I64: case OP_PROD << 4 | T_U64: WRAPPING(uint64_t, *); return 1;
    case OP_MIN << 4 | T_I32: ORDERED(int32_t, <); return 1;
    case OP_MIN << 4 | T_I64: ORDERED(int64_t, <); return 1;
    case OP_MIN << 4 | T_U32: ORDERED(uint32_t, <); return 1;
    case OP_MIN << 4 | T_U64: ORDERED(uint64_t, <); return 1;
    case OP_MAX << 4 | T_I32: ORDERED(int32_t, >); return 1;
    case OP_MAX << 4 | T_I64: ORDERED(int64_t, >); return 1;
    case OP_MAX << 4 | T_U32: ORDERED(uint32_t, >); return 1;
    case OP_MAX << 4 | T_U64: ORDERED(uint64_t, >); return 1;
    }
    return 0;
}

/* What reduces what among whom: collective/shm.py's plan tuple, (code, sig, desc, which,
 * ranks, pauses, long_ns), read into C. */
typedef struct {
    int code, which, m, ranks[MAX_RANKS];
    uint64_t sig, desc;
    Spin spin;
} Plan;

static int read_plan(Reducer *self, PyObject *obj, Plan *p) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 7) {
        PyErr_SetString(PyExc_TypeError, "plan: (code, sig, desc, which, ranks, pauses, long_ns)");
        return -1;
    }
    p->code = (int)PyLong_AsLong(PyTuple_GET_ITEM(obj, 0));
    p->sig = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(obj, 1));
    p->desc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(obj, 2));
    p->which = (int)PyLong_AsLong(PyTuple_GET_ITEM(obj, 3));
    p->spin.pauses = (int)PyLong_AsLong(PyTuple_GET_ITEM(obj, 5));
    p->spin.long_ns = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 6));
    p->spin.budget_ns = 0;
    if (PyErr_Occurred()) return -1;
    PyObject *ranks = PyTuple_GET_ITEM(obj, 4);
    if (!PyTuple_Check(ranks) || (p->which != 0 && p->which != 1)) {
        PyErr_SetString(PyExc_TypeError, "plan: ranks must be a tuple, which 0 or 1");
        return -1;
    }
    p->m = (int)PyTuple_GET_SIZE(ranks);
    if (p->m < 1 || p->m > self->n) {
        PyErr_SetString(PyExc_ValueError, "ranks: between 1 and the number of workers");
        return -1;
    }
    for (int k = 0; k < p->m; k++) {
        long r = PyLong_AsLong(PyTuple_GET_ITEM(ranks, k));
        if (r < 0 || r >= self->n) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a rank out of range");
            return -1;
        }
        p->ranks[k] = (int)r;
    }
    return 0;
}

/* out, a writeable C-contiguous buffer of a's size (a: at most a slot) that p's code
 * reduces; -1 with an error set, before anything is published, if not. */
static int take_out(Reducer *self, Py_buffer *a, PyObject *obj, Py_buffer *out, const Plan *p) {
    if (PyObject_GetBuffer(obj, out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    int size = item_size(p->code);
    if (out->len != a->len || a->len > self->slot_size) {
        PyErr_SetString(PyExc_ValueError, "a and out: the same size, at most a slot");
    } else if (!size || a->len % size) {
        PyErr_Format(PyExc_ValueError, "no reduction has code %d for %zd bytes", p->code,
                     a->len);
    } else {
        return 0;
    }
    PyBuffer_Release(out);
    return -1;
}

/* The steps from ``stage`` on (see the top of this file) -> status; -1 with an error set. */
static int steps(Reducer *self, const Py_buffer *a, const Py_buffer *out, const Plan *p,
                 uint64_t gen, int stage) {
    uint64_t *q = self->q;
    Py_ssize_t me = self->rec[self->rank], nbytes = a->len;
    int parity = (int)((gen >> 2) & 1), which = p->which, m = p->m, long_seen = 0, status;
    if (stage == 0) {
        q[me + NBYTES] = (uint64_t)nbytes;
        q[me + SIG] = p->sig;
        PyThreadState *ts = nbytes >= UNLOCKED ? PyEval_SaveThread() : NULL;
        memcpy(self->base + self->slot[self->rank], a->buf, (size_t)nbytes);
        if (ts) PyEval_RestoreThread(ts);
        q[me + DESC + 4 * which + 2 * parity] = p->desc;
        q[me + DESC + 4 * which + 2 * parity + 1] = 0;
        store(&q[me + which], gen);
        uint64_t next = (gen >> CALL_SHIFT) + 1; /* a meeting counts this call's arrivals only */
        uint64_t top = next < MAX_CALL ? next << CALL_SHIFT : UINT64_MAX;
        if (!await_short(self, p->ranks, m, which, gen, top, &p->spin, &long_seen))
            return MEET | (long_seen ? LONG : 0);
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* stage 1: the caller saw them arrive */
    char *parts[MAX_RANKS];
    for (int k = 0; k < m; k++) {
        Py_ssize_t r = self->rec[p->ranks[k]];
        Py_ssize_t at = r + DESC + 4 * which + 2 * parity;
        if (q[at] != p->desc || q[at + 1] != 0 || q[r + NBYTES] != (uint64_t)nbytes ||
            q[r + SIG] != p->sig)
            return MISMATCH | (long_seen ? LONG : 0);
        parts[k] = self->base + self->slot[p->ranks[k]];
    }
    PyThreadState *ts = nbytes >= UNLOCKED ? PyEval_SaveThread() : NULL;
    int folded = fold(p->code, (char *)out->buf, parts, m, nbytes);
    if (ts) PyEval_RestoreThread(ts);
    if (!folded) { /* take_out() checked that it would */
        PyErr_Format(PyExc_SystemError, "no reduction has code %d", p->code);
        return -1;
    }
    store(&q[me + which], gen | 1);
    status = await_short(self, p->ranks, m, which, gen | 1, UINT64_MAX, &p->spin, &long_seen)
                 ? DONE : DEPART;
    return status | (long_seen ? LONG : 0);
}

/* Whether shm.py's _settle would do anything about what scope k owes (None, or a tuple
 * (call, need, ranks, failed)): only not where nothing is owed, or where it is owed from a
 * collective of this call that succeeded. */
static int owes(PyObject *owe, Py_ssize_t k, uint64_t call) {
    PyObject *o = PyList_GET_ITEM(owe, k);
    if (o == Py_None) return 0;
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 4 || PyTuple_GET_ITEM(o, 3) != Py_False)
        return 1;
    uint64_t c = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 0));
    if (c == (uint64_t)-1 && PyErr_Occurred()) PyErr_Clear();
    return c != call;
}

/* small(a, out, plan, call, budget_ns) -> status (see the top of this file), or PASS with
 * nothing done: where a is not C-contiguous, or where something is owed that shm.py's
 * _settle waits for or raises on. The caller then settles, copies and calls again. FULL,
 * with nothing done, where the generation would not fit (as _next raises).
 *
 * Otherwise it takes the collective's generation as shm.py's _next does (the owner's
 * _index and _owe), in call ``call``, and runs the steps, its waits yield-spinning for at
 * most budget_ns. DONE leaves nothing owed; any other status leaves _owe[which] as _next
 * does (failed, until the caller finishes the collective), with the generation in
 * last_gen. */
static PyObject *Reducer_small(Reducer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "small takes 5 arguments");
        return NULL;
    }
    if (released(self)) return NULL;
    if (!self->index) {
        PyErr_SetString(PyExc_TypeError, "small needs an owner (its _index and _owe)");
        return NULL;
    }
    Plan p;
    if (read_plan(self, args[2], &p) < 0) return NULL;
    uint64_t call = PyLong_AsUnsignedLongLong(args[3]);
    p.spin.budget_ns = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (owes(self->owe, 0, call) || owes(self->owe, 1, call)) return PyLong_FromLong(PASS);
    Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(self->index, p.which));
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i >= MAX_INDEX || call >= MAX_CALL) return PyLong_FromLong(FULL);
    Py_buffer a, out;
    if (PyObject_GetBuffer(args[0], &a, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* not C-contiguous: the caller copies */
        return PyLong_FromLong(PASS);
    }
    if (take_out(self, &a, args[1], &out, &p) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    PyObject *result = NULL;
    /* _next: take the generation */
    PyObject *next = i < 0 ? NULL : PyLong_FromSsize_t(i + 1);
    if (!next) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_index: a negative count");
        goto finally;
    }
    PyList_SetItem(self->index, p.which, next); /* steals next */
    uint64_t gen = (call << CALL_SHIFT) | ((uint64_t)i << 2);
    self->last_gen = gen;
    int status = steps(self, &a, &out, &p, gen, 0);
    PyObject *owed = Py_None;
    if (status != DONE) { /* as _next left it: failed until the caller finishes */
        owed = Py_BuildValue("(KKOO)", (unsigned long long)call, (unsigned long long)(gen | 1),
                             PyTuple_GET_ITEM(args[2], 4), Py_True);
        if (!owed) goto finally;  /* (the steps' error, if any, stays the one raised) */
    } else {
        Py_INCREF(owed);
    }
    PyList_SetItem(self->owe, p.which, owed); /* steals owed */
    if (status >= 0) result = PyLong_FromLong(status);
finally:
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return result;
}

/* after_meet(a, out, plan, gen) -> status: stage 1 of small's collective at gen, once the
 * caller saw every peer arrive; its departure does not wait (DEPART: the caller waits). */
static PyObject *Reducer_after_meet(Reducer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "after_meet takes 4 arguments");
        return NULL;
    }
    if (released(self)) return NULL;
    Plan p;
    if (read_plan(self, args[2], &p) < 0) return NULL;
    p.spin.pauses = 0;
    uint64_t gen = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer a, out;
    if (PyObject_GetBuffer(args[0], &a, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (take_out(self, &a, args[1], &out, &p) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    int status = steps(self, &a, &out, &p, gen, 1);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return status < 0 ? NULL : PyLong_FromLong(status);
}

/* The worker finished call ``call``: peers waiting for us in it give up (the release store
 * of our "left" word, as shm.py's end); then the owner tidies where it holds something. */
static PyObject *Reducer_end(Reducer *self, PyObject *arg) {
    unsigned long long call = PyLong_AsUnsignedLongLong(arg);
    if (call == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (released(self)) return NULL;
    store(&self->q[self->rec[self->rank] + LEFT], (uint64_t)call);
    if (self->owner && (PyDict_GET_SIZE(self->spills) || PyDict_GET_SIZE(self->pidfds))) {
        PyObject *owner;
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(self->owner, &owner) < 0) return NULL;
#else
        owner = PyWeakref_GetObject(self->owner); /* borrowed */
        if (!owner) return NULL;
        owner = owner == Py_None ? NULL : Py_NewRef(owner);
#endif
        if (owner) {  /* else it is gone, and its dicts go with this object */
            PyObject *got = PyObject_CallMethod(owner, "_tidy", NULL);
            Py_DECREF(owner);
            return got;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef Reducer_methods[] = {
    {"end", (PyCFunction)Reducer_end, METH_O,
     "end(call_id): our left word; then owner._tidy() where it holds spills or pidfds"},
    {"small", (PyCFunction)(void (*)(void))Reducer_small, METH_FASTCALL,
     "small(a, out, plan, call, budget_ns) -> status: a small allreduce, its generation "
     "taken as shm.py's _next does"},
    {"after_meet", (PyCFunction)(void (*)(void))Reducer_after_meet, METH_FASTCALL,
     "after_meet(a, out, plan, gen) -> status: small's steps after its meeting"},
    {"release", (PyCFunction)Reducer_release, METH_NOARGS,
     "release(): let go of the mapping; any use after raises ValueError"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Reducer_members[] = {
    {"last_gen", T_ULONGLONG, offsetof(Reducer, last_gen), READONLY,
     "the generation small() last took"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ReducerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "unison._coll.Reducer",
    .tp_basicsize = sizeof(Reducer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reducer(buffer, rank, records, slots, slot_size, owner=None)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reducer_init,
    .tp_dealloc = (destructor)Reducer_dealloc,
    .tp_methods = Reducer_methods,
    .tp_members = Reducer_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "unison._coll",
    "A small allreduce's shared-memory steps in C (see collective/shm.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__coll(void) {
    if (PyType_Ready(&ReducerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ReducerType);
    if (PyModule_AddStringConstant(m, "SOURCE", UNISON_SOURCE) < 0 ||
        PyModule_AddObject(m, "Reducer", (PyObject *)&ReducerType) < 0 ||
        PyModule_AddObject(m, "RECORD", Py_BuildValue("(iiiiiii)", GEN_W, GEN_G, LEFT, PID,
                                                      NBYTES, SIG, DESC)) < 0 ||
        PyModule_AddObject(m, "GENERATION", Py_BuildValue("(iLK)", CALL_SHIFT,
                                                          (long long)MAX_INDEX,
                                                          (unsigned long long)MAX_CALL)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
