/* unison._ring: the shm channel's command ring in C, its fast paths only (issue 9).
 *
 * channel/shm.py owns the layout and every slow path (room, wraps to make, buffers, waits);
 * this file does what every message pays: the controller's publish of a plain entry, the
 * worker's take of the next one (its progress published first, entries for others and
 * wrap markers skipped), and the worker's put of a plain reply (put_plain: marshalled
 * here). Same layout, same protocol, with real fences:
 *
 *   send:    (a plain entry that fits before the ring's end and the limit; else False,
 *            and shm.py's send makes room or places buffers) header, rank mask, payload;
 *            release-store cmd_write; full fence; read the targets' sleeping flags; write
 *            the eventfd of each one that sleeps. The write position and the limit live
 *            here (wpos, limit), so that the session's send is this one call.
 *   take:    done = pos; full fence; read the controller's "waiting on progress" flag and
 *            write its eventfd if up; acquire-load cmd_write; parse the entry at pos.
 *   values:  run's replies, all or none: acquire-load each rank's reply position; once
 *            every rank has one, decode each (marshal), check it is (req_id, OK, value),
 *            then release-store each rank's read position (the space back to the worker).
 *
 * Besides the ring: fence(), a full memory barrier for the Python sides' handshakes, and
 * Mark, a worker's word on the cancellation board (cancel.py), written around every call.
 *
 * A pure-Python fallback (shm.py, cancel._Mark) is chosen automatically when this does not
 * build or UNISON_PURE=1 is set. Word indices and offsets come from Python (shm._Layout).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <marshal.h>
#include <stddef.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <errno.h>

/* The start of this file's sha256, set by setup.py; unison._native refuses a module whose
   SOURCE differs from the file beside it (a stale build). */
#ifndef UNISON_SOURCE
#define UNISON_SOURCE ""
#endif

#define WRAP UINT64_MAX
#define ENTRY 16
#define DESC 24
#define MAX_WORKERS 64
#define FLAGS 32  /* a head's length lies below this bit, its flags from it up (a reply's:
                     shm._MORE, _INDIRECT, _NDESC; a command's: its meta) */
#define STATUS_OK 0  /* protocol.OK, as the module's OK: a test checks that they agree */
#define STATUS_ARRAY 2  /* protocol.ARRAY, likewise: a small numpy value, made by array_value */

static inline void wake(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof one);
    (void)r; /* EAGAIN: the counter is already non-zero, the sleeper wakes anyway */
}

/* A worker's wake of the controller: 0, or -1 with OSError set where the write failed but
 * for a full counter (EAGAIN): code in this process closed unison's eventfd (EBADF), or put
 * something that is no eventfd under its number (EINVAL). Ignored, each wake was lost and
 * the controller slept out its timeout; the worker now ends, saying why. */
static int wake_checked(int fd) {
    uint64_t one = 1;
    if (write(fd, &one, sizeof one) >= 0 || errno == EAGAIN) return 0;
    int err = errno;
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "iN", err, PyUnicode_FromFormat(
        "%s: worker code closed or replaced unison's descriptor %d (an eventfd), so the "
        "controller cannot be woken; leave alone the descriptors it did not open (no "
        "os.closerange or os.dup2 over them)", strerror(err), fd));
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return -1;
}

/* ---- the controller's end --------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *q;
    char *base;
    Py_ssize_t cmd_base;
    uint64_t ring;
    int n;
    int efd[MAX_WORKERS];
    Py_ssize_t sleep_idx[MAX_WORKERS];
    /* the workers' reply rings (set by replies()), and what makes an ARRAY reply's value */
    uint64_t rring;
    Py_ssize_t rbase[MAX_WORKERS], rw_idx[MAX_WORKERS], rr_idx[MAX_WORKERS];
    PyObject *array_value;
    /* how far each worker has run, and whether it holds unreported errors (progress()) */
    Py_ssize_t done_idx[MAX_WORKERS], unrep_idx[MAX_WORKERS];
    /* the ring's head: where the next entry goes, and how far it may grow without a look
     * at the workers' read positions (shm.py's slow paths read and move both) */
    unsigned long long wpos, limit;
} Sender;

static void Sender_dealloc(Sender *self) {
    if (self->view.obj) PyBuffer_Release(&self->view);
    Py_CLEAR(self->array_value);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Every look at the mapping (a Sender's or a Taker's words, ``q``) checks this first:
 * after release() it raises, never reads. */
static int released(const uint64_t *q) {
    if (q) return 0;
    PyErr_SetString(PyExc_ValueError, "the channel is closed (its session was closed): "
                    "open a new Session to go on");
    return 1;
}

/* release()'s steps, a Sender's or a Taker's: the view let go, the pointers into it gone */
static void let_go(Py_buffer *view, uint64_t **q, char **base) {
    if (view->obj) PyBuffer_Release(view);
    *q = NULL;
    *base = NULL;
}

/* release(): let go of the mapping now, so the channel can unmap it whoever still holds
 * this object (a frame of a traceback, after a Ctrl-C in a wait); any use then raises */
static PyObject *Sender_release(Sender *self, PyObject *unused) {
    (void)unused;
    let_go(&self->view, &self->q, &self->base);
    Py_RETURN_NONE;
}

static int Sender_init(Sender *self, PyObject *args, PyObject *kw) {
    PyObject *buf, *efds, *sleeps;
    Py_ssize_t cmd_base;
    unsigned long long ring;
    if (!PyArg_ParseTuple(args, "OnKOO", &buf, &cmd_base, &ring, &efds, &sleeps)) return -1;
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->q = (uint64_t *)self->view.buf;
    self->base = (char *)self->view.buf;
    self->cmd_base = cmd_base;
    self->ring = ring;
    self->wpos = 0;
    self->limit = ring;
    Py_ssize_t n = PySequence_Size(efds);
    if (n < 0 || n > MAX_WORKERS || PySequence_Size(sleeps) != n) {
        PyErr_SetString(PyExc_ValueError, "efds and sleeping indices: one per worker, <= 64");
        return -1;
    }
    self->n = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PySequence_GetItem(efds, i), *s = PySequence_GetItem(sleeps, i);
        if (!e || !s) { Py_XDECREF(e); Py_XDECREF(s); return -1; }
        self->efd[i] = (int)PyLong_AsLong(e);
        self->sleep_idx[i] = PyLong_AsSsize_t(s);
        Py_DECREF(e); Py_DECREF(s);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* send(payload, ranks) -> True once the entry is published to ``ranks`` (a tuple of ranks);
 * False, with nothing written, where the payload is over a quarter of the ring (the arena
 * takes it: shm._INLINE_MAX), a rank is out of range, or the entry does not fit between
 * the head and the ring's end or the limit: shm.py's send then makes room. */
static PyObject *Sender_send(Sender *self, PyObject *const *args, Py_ssize_t nargs) {
    if (released(self->q)) return NULL;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "send takes 2 arguments"); return NULL; }
    PyObject *ranks = args[1];
    if (!PyTuple_Check(ranks)) Py_RETURN_FALSE;
    uint64_t mask = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ranks); i++) {
        long r = PyLong_AsLong(PyTuple_GET_ITEM(ranks, i));
        if (r == -1 && PyErr_Occurred()) return NULL;
        if (r < 0 || r >= self->n) Py_RETURN_FALSE;
        mask |= (uint64_t)1 << r;
    }
    Py_buffer p;
    if (PyObject_GetBuffer(args[0], &p, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t n = (uint64_t)p.len, pos = self->wpos;
    uint64_t size = (ENTRY + 7 + n) & ~(uint64_t)7;
    uint64_t off = pos & (self->ring - 1);
    if (n > self->ring / 4 || off + size > self->ring || pos + size > self->limit) {
        PyBuffer_Release(&p);
        Py_RETURN_FALSE;
    }
    char *entry = self->base + self->cmd_base + off;
    uint64_t *head = (uint64_t *)entry;
    head[0] = n;          /* meta 0: no buffers, no flags */
    head[1] = mask;
    memcpy(entry + ENTRY, p.buf, n);
    PyBuffer_Release(&p);
    self->wpos = pos + size;
    __atomic_store_n(&self->q[0], pos + size, __ATOMIC_RELEASE);  /* the entry, then its position */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);                      /* then read the sleeping flags */
    for (int r = 0; r < self->n; r++) {
        if ((mask >> r) & 1 && __atomic_load_n(&self->q[self->sleep_idx[r]], __ATOMIC_RELAXED))
            wake(self->efd[r]);
    }
    Py_RETURN_TRUE;
}

/* Each worker's entry of the sequence ``seq`` (word indices, offsets), into ``out`` */
static int indices(PyObject *seq, int n, Py_ssize_t *out) {
    if (PySequence_Size(seq) != n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "one index per worker expected");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (!item) return -1;
        out[i] = PyLong_AsSsize_t(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* replies(rbases, rw_indices, rr_indices, ring_size, array_value=None): where each worker's
 * reply ring is, and the callable that makes an ARRAY reply's value (None: the slow path) */
static PyObject *Sender_replies(Sender *self, PyObject *args) {
    PyObject *rb, *rw, *rr, *array_value = Py_None;
    unsigned long long ring;
    if (!PyArg_ParseTuple(args, "OOOK|O", &rb, &rw, &rr, &ring, &array_value)) return NULL;
    if (indices(rb, self->n, self->rbase) < 0 || indices(rw, self->n, self->rw_idx) < 0 ||
        indices(rr, self->n, self->rr_idx) < 0)
        return NULL;
    self->rring = ring;
    Py_XSETREF(self->array_value, array_value == Py_None ? NULL : Py_NewRef(array_value));
    Py_RETURN_NONE;
}

/* pending(positions) -> whether a worker's reply ring holds anything past positions[r] */
static PyObject *Sender_pending(Sender *self, PyObject *positions) {
    if (released(self->q)) return NULL;
    if (!PyList_Check(positions) || PyList_GET_SIZE(positions) != self->n) {
        PyErr_SetString(PyExc_TypeError, "pending takes the list of reply positions");
        return NULL;
    }
    for (int r = 0; r < self->n; r++) {
        uint64_t pos = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(positions, r));
        if (PyErr_Occurred()) return NULL;
        if (__atomic_load_n(&self->q[self->rw_idx[r]], __ATOMIC_ACQUIRE) != pos) Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* progress(done_indices, unreported_indices): where each worker publishes how far it has
 * run and whether it holds errors nobody fetched */
static PyObject *Sender_progress(Sender *self, PyObject *args) {
    PyObject *done, *unrep;
    if (!PyArg_ParseTuple(args, "OO", &done, &unrep)) return NULL;
    if (indices(done, self->n, self->done_idx) < 0 || indices(unrep, self->n, self->unrep_idx) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* settled(rankmask, mark) -> 0 while a worker in rankmask has not run everything before
 * mark; else 1, or 2 where one of them holds errors nobody fetched (sync's check: one call
 * where Python took a loop and a function each) */
static PyObject *Sender_settled(Sender *self, PyObject *const *args, Py_ssize_t nargs) {
    if (released(self->q)) return NULL;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "settled takes 2 arguments"); return NULL; }
    uint64_t mask = PyLong_AsUnsignedLongLong(args[0]);
    uint64_t mark = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    for (int r = 0; r < self->n; r++)
        if ((mask >> r) & 1 && __atomic_load_n(&self->q[self->done_idx[r]], __ATOMIC_ACQUIRE) < mark)
            return PyLong_FromLong(0);
    for (int r = 0; r < self->n; r++)  /* published before the done position: seen now */
        if ((mask >> r) & 1 && __atomic_load_n(&self->q[self->unrep_idx[r]], __ATOMIC_RELAXED))
            return PyLong_FromLong(2);
    return PyLong_FromLong(1);
}

/* What next_reply found at a rank's read position. */
enum { REPLY_NONE, REPLY_OTHER, REPLY_PLAIN };

/* The entry of rank r's reply ring at *pos, up to the published position end, a wrap marker
 * skipped (*pos then moves past it): REPLY_NONE when nothing is published there yet;
 * REPLY_OTHER when the entry has flags (buffers, indirect, chunks) or it, or the position,
 * breaks the format (the slow path reads and judges it); else REPLY_PLAIN, with its bytes
 * at *data, *n of them, and *size its length in the ring. The worker wrote these bytes:
 * nothing outside the ring is read, and each step moves toward end. */
static int next_reply(Sender *self, int r, uint64_t *pos, uint64_t end, const char **data,
                      uint64_t *n, uint64_t *size) {
    if (end - *pos > self->rring) return REPLY_OTHER;
    if (*pos == end) return REPLY_NONE;
    uint64_t off = *pos & (self->rring - 1);
    const char *entry = self->base + self->rbase[r] + off;
    if (*(const uint64_t *)entry == WRAP) {
        if (self->rring - off > end - *pos) return REPLY_OTHER;
        *pos += self->rring - off;
        if (*pos == end) return REPLY_NONE;
        off = 0;
        entry = self->base + self->rbase[r];
    }
    uint64_t head = *(const uint64_t *)entry;
    *n = head & (((uint64_t)1 << FLAGS) - 1);
    *size = (8 + *n + 7) & ~(uint64_t)7;
    if (head >> FLAGS || off + *size > self->rring || *size > end - *pos) return REPLY_OTHER;
    *data = entry + 8;
    return REPLY_PLAIN;
}

/* collect(positions) -> (replies, more): every plain reply now in the rings, as (rank,
 * bytes) in each rank's order, positions[r] advanced and the space handed back (reply_read).
 * A rank stops at its first entry with flags (buffers, indirect, chunks): ``more`` is then
 * True and the caller's slow path reads on from positions[r]. The worker wrote these bytes:
 * a rank also stops, the same way, at a position or an entry that breaks the format (past
 * its ring, past its published position), which the slow path then reports; nothing is
 * read outside the ring, and each step moves toward the published position. */
static PyObject *Sender_collect(Sender *self, PyObject *positions) {
    if (released(self->q)) return NULL;
    if (!self->rring) { PyErr_SetString(PyExc_RuntimeError, "replies() was not called"); return NULL; }
    if (!PyList_Check(positions) || PyList_GET_SIZE(positions) != self->n) {
        PyErr_SetString(PyExc_TypeError, "collect takes the list of reply positions");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    int more = 0;
    uint64_t *q = self->q;
    for (int r = 0; r < self->n; r++) {
        uint64_t start = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(positions, r)), pos = start;
        if (PyErr_Occurred()) goto fail;
        uint64_t end = __atomic_load_n(&q[self->rw_idx[r]], __ATOMIC_ACQUIRE);
        const char *bytes;
        uint64_t n, size;
        int kind;
        while ((kind = next_reply(self, r, &pos, end, &bytes, &n, &size)) == REPLY_PLAIN) {
            PyObject *data = PyBytes_FromStringAndSize(bytes, (Py_ssize_t)n);
            if (!data) goto fail;
            PyObject *item = Py_BuildValue("(iN)", r, data);
            if (!item || PyList_Append(out, item) < 0) { Py_XDECREF(item); goto fail; }
            Py_DECREF(item);
            pos += size;
        }
        if (kind == REPLY_OTHER) more = 1;  /* the slow path reads on from pos */
        if (pos == start) continue;
        PyObject *p = PyLong_FromUnsignedLongLong(pos);
        if (!p) goto fail;
        PyList_SetItem(positions, r, p);  /* steals p */
        __atomic_store_n(&q[self->rr_idx[r]], pos, __ATOMIC_RELEASE);  /* hand the space back */
    }
    return Py_BuildValue("(NO)", out, more ? Py_True : Py_False);
fail:
    Py_DECREF(out);
    return NULL;
}

/* values(positions, ranks, req_id, partial) -> run's usual replies in one step (the
 * router's quick path): None while a rank of the tuple ranks has no reply past
 * positions[r]; True when a rank's next reply is anything but a plain marshal of (req_id,
 * OK, value), or breaks the format, or when partial[r] (the parts of a chunked reply read
 * so far) is not empty, as the next entry is then a chunk, not a reply: then nothing is
 * read, and the slow path (collect, the router) reads and judges it. Else the list of the
 * values in ranks' order, each positions[r] advanced past its reply and the space handed
 * back. */
static PyObject *Sender_values(Sender *self, PyObject *const *args, Py_ssize_t nargs) {
    if (released(self->q)) return NULL;
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "values takes 4 arguments"); return NULL; }
    if (!self->rring) { PyErr_SetString(PyExc_RuntimeError, "replies() was not called"); return NULL; }
    PyObject *positions = args[0], *ranks = args[1], *partial = args[3];
    if (!PyList_Check(positions) || PyList_GET_SIZE(positions) != self->n || !PyTuple_Check(ranks) ||
        !PyList_Check(partial) || PyList_GET_SIZE(partial) != self->n) {
        PyErr_SetString(PyExc_TypeError, "values takes the lists of reply positions, a tuple "
                        "of ranks, a request id and the lists of chunks read");
        return NULL;
    }
    long long want = PyLong_AsLongLong(args[2]);
    if (want == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(ranks);
    if (k < 1 || k > self->n) Py_RETURN_TRUE;
    int rank[MAX_WORKERS];
    uint64_t at[MAX_WORKERS], len[MAX_WORKERS], seen = 0;
    const char *body[MAX_WORKERS];
    for (Py_ssize_t i = 0; i < k; i++) {  /* every rank's reply in? (no decoding while not) */
        long r = PyLong_AsLong(PyTuple_GET_ITEM(ranks, i));
        if (r == -1 && PyErr_Occurred()) return NULL;
        if (r < 0 || r >= self->n || (seen >> r) & 1) Py_RETURN_TRUE;
        seen |= (uint64_t)1 << r;
        rank[i] = (int)r;
        if (PyObject_Length(PyList_GET_ITEM(partial, r)) != 0) {  /* mid-chunks (or not a list) */
            PyErr_Clear();
            Py_RETURN_TRUE;
        }
        uint64_t pos = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(positions, r)), size;
        if (PyErr_Occurred()) return NULL;
        uint64_t end = __atomic_load_n(&self->q[self->rw_idx[r]], __ATOMIC_ACQUIRE);
        int kind = next_reply(self, (int)r, &pos, end, &body[i], &len[i], &size);
        if (kind == REPLY_NONE) Py_RETURN_NONE;
        if (kind == REPLY_OTHER || len[i] == 0)
            Py_RETURN_TRUE;  /* flags or bad bytes, an acknowledgement */
        at[i] = pos + size;
    }
    PyObject *out = PyList_New(k);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *reply = PyMarshal_ReadObjectFromString(body[i], (Py_ssize_t)len[i]);
        if (!reply) { PyErr_Clear(); goto slow; }  /* a pickle, or bytes the slow path judges */
        int overflow;
        long status = -1;
        if (!PyTuple_CheckExact(reply) || PyTuple_GET_SIZE(reply) != 3 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(reply, 0)) ||
            PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(reply, 0), &overflow) != want ||
            overflow || !PyLong_CheckExact(PyTuple_GET_ITEM(reply, 1)) ||
            ((status = PyLong_AsLong(PyTuple_GET_ITEM(reply, 1))) != STATUS_OK &&
             (status != STATUS_ARRAY || !self->array_value))) {
            PyErr_Clear();
            Py_DECREF(reply);
            goto slow;
        }
        PyObject *value = PyTuple_GET_ITEM(reply, 2);
        if (status == STATUS_ARRAY) {  /* its value made here (a bad one: the slow path says) */
            value = PyObject_CallOneArg(self->array_value, value);
            if (!value) { PyErr_Clear(); Py_DECREF(reply); goto slow; }
        } else {
            Py_INCREF(value);
        }
        PyList_SET_ITEM(out, i, value);
        Py_DECREF(reply);
    }
    PyObject *moved[MAX_WORKERS];  /* the new positions, all made before any is stored */
    for (Py_ssize_t i = 0; i < k; i++) {
        moved[i] = PyLong_FromUnsignedLongLong(at[i]);
        if (!moved[i]) {  /* nothing consumed: the caller's error leaves the rings in step */
            while (i--) Py_DECREF(moved[i]);
            Py_DECREF(out);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < k; i++) {  /* all read: consume them */
        PyList_SetItem(positions, rank[i], moved[i]);  /* steals it */
        __atomic_store_n(&self->q[self->rr_idx[rank[i]]], at[i], __ATOMIC_RELEASE);
    }
    return out;
slow:
    Py_DECREF(out);
    Py_RETURN_TRUE;
}

static PyMethodDef Sender_methods[] = {
    {"replies", (PyCFunction)Sender_replies, METH_VARARGS,
     "replies(rbases, rw_indices, rr_indices, ring_size)"},
    {"pending", (PyCFunction)Sender_pending, METH_O, "pending(positions) -> bool"},
    {"progress", (PyCFunction)Sender_progress, METH_VARARGS,
     "progress(done_indices, unreported_indices)"},
    {"settled", (PyCFunction)(void (*)(void))Sender_settled, METH_FASTCALL,
     "settled(rankmask, mark) -> 0 not done, 1 done, 2 done with unreported errors"},
    {"collect", (PyCFunction)Sender_collect, METH_O,
     "collect(positions) -> ([(rank, bytes)], more)"},
    {"release", (PyCFunction)Sender_release, METH_NOARGS,
     "release(): let go of the mapping; any use after raises ValueError"},
    {"values", (PyCFunction)(void (*)(void))Sender_values, METH_FASTCALL,
     "values(positions, ranks, req_id, partial) -> None not all in, True slow path, else [value]"},
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL,
     "send(payload, ranks) -> True once published; False: nothing written (slow path)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Sender_members[] = {
    {"wpos", T_ULONGLONG, offsetof(Sender, wpos), 0, "where the next entry goes"},
    {"limit", T_ULONGLONG, offsetof(Sender, limit), 0,
     "how far the head may grow before the workers' read positions are looked at again"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "unison._ring.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sender(buffer, cmd_base, ring_size, efds, sleeping_indices)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sender_init,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_members = Sender_members,
};

/* ---- a worker's end ---------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *q;
    char *base;
    Py_ssize_t cmd_base;
    uint64_t ring;
    uint64_t bit;
    Py_ssize_t read_idx, done_idx, ctl_done_idx;
    int done_efd;
    /* this worker's reply ring (set by replies()) */
    Py_ssize_t rbase, rw_idx, rr_idx, ctl_sleep_idx, ctl_async_idx;
    uint64_t rring;
    int ctl_efd;
} Taker;

static void Taker_dealloc(Taker *self) {
    if (self->view.obj) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* release(): as Sender's, for worker 0 inline in the controller, whose serving frame a
 * traceback user code kept may hold this object past the session */
static PyObject *Taker_release(Taker *self, PyObject *unused) {
    (void)unused;
    let_go(&self->view, &self->q, &self->base);
    Py_RETURN_NONE;
}

static int Taker_init(Taker *self, PyObject *args, PyObject *kw) {
    PyObject *buf;
    Py_ssize_t cmd_base, read_idx, done_idx, ctl_done_idx;
    unsigned long long ring, bit;
    int done_efd;
    if (!PyArg_ParseTuple(args, "OnKKnnni", &buf, &cmd_base, &ring, &bit, &read_idx,
                          &done_idx, &ctl_done_idx, &done_efd))
        return -1;
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->q = (uint64_t *)self->view.buf;
    self->base = (char *)self->view.buf;
    self->cmd_base = cmd_base;
    self->ring = ring;
    self->bit = bit;
    self->read_idx = read_idx;
    self->done_idx = done_idx;
    self->ctl_done_idx = ctl_done_idx;
    self->done_efd = done_efd;
    return 0;
}

/* take(pos) -> (payload, new_pos): the next plain entry for this worker, copied out, its
 * space handed back; (None, pos) when the ring is empty at pos (the caller waits); (False,
 * pos) when the entry at pos carries buffers or lies in the arena (the caller parses it).
 * Everything before pos has run: that is published first (done), waking the controller
 * if it waits on progress. Entries for other workers and wrap markers are skipped. An entry
 * or a position that breaks the format (past the ring, past the published position) is
 * (False, pos) too: the caller's parser reports it. Nothing is read outside the ring. */
static PyObject *Taker_take(Taker *self, PyObject *arg) {
    uint64_t pos = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || released(self->q)) return NULL;
    uint64_t *q = self->q;
    for (;;) {
        if (__atomic_load_n(&q[self->done_idx], __ATOMIC_RELAXED) != pos) {
            __atomic_store_n(&q[self->done_idx], pos, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            if (__atomic_load_n(&q[self->ctl_done_idx], __ATOMIC_RELAXED) &&
                wake_checked(self->done_efd) < 0)
                return NULL;
        }
        uint64_t end = __atomic_load_n(&q[0], __ATOMIC_ACQUIRE);
        if (end == pos)
            return Py_BuildValue("(OK)", Py_None, (unsigned long long)pos);
        if (end - pos > self->ring)  /* malformed: the caller's parser says so */
            return Py_BuildValue("(OK)", Py_False, (unsigned long long)pos);
        uint64_t off = pos & (self->ring - 1);
        uint64_t *entry = (uint64_t *)(self->base + self->cmd_base + off);
        uint64_t head = entry[0];
        if (head == WRAP) {
            if (self->ring - off > end - pos)
                return Py_BuildValue("(OK)", Py_False, (unsigned long long)pos);
            pos += self->ring - off;  /* the next lap */
            continue;
        }
        uint64_t n = head & (((uint64_t)1 << FLAGS) - 1), meta = head >> FLAGS;
        uint64_t size = (ENTRY + 7 + n + DESC * (meta & 0xFFFF)) & ~(uint64_t)7;
        if (off + size > self->ring || size > end - pos)
            return Py_BuildValue("(OK)", Py_False, (unsigned long long)pos);
        if (!(entry[1] & self->bit)) {
            pos += size;
            __atomic_store_n(&q[self->read_idx], pos, __ATOMIC_RELEASE);
            continue;
        }
        if (meta)
            return Py_BuildValue("(OK)", Py_False, (unsigned long long)pos);
        PyObject *payload = PyBytes_FromStringAndSize((char *)entry + ENTRY, (Py_ssize_t)n);
        if (!payload) return NULL;
        pos += size;
        __atomic_store_n(&q[self->read_idx], pos, __ATOMIC_RELEASE);  /* after the copy */
        return Py_BuildValue("(NK)", payload, (unsigned long long)pos);
    }
}

/* replies(rbase, ring_size, rw_idx, rr_idx, ctl_sleep_idx, ctl_async_idx, ctl_efd) */
static PyObject *Taker_replies(Taker *self, PyObject *args) {
    unsigned long long rring;
    if (!PyArg_ParseTuple(args, "nKnnnni", &self->rbase, &rring, &self->rw_idx, &self->rr_idx,
                          &self->ctl_sleep_idx, &self->ctl_async_idx, &self->ctl_efd))
        return NULL;
    self->rring = rring;
    Py_RETURN_NONE;
}

/* One plain reply entry of n bytes at this worker's reply position (its own word, written
 * by nobody else): header n, then the bytes; release-store of the position, a full fence,
 * then the controller's two wake flags. 0; -2, with OSError set, where the entry went out but
 * its wake failed (wake_checked); or -1 with nothing written where the entry would
 * cross the ring's end, the ring is full, or the body is over a quarter of the ring (it goes
 * through the reply arena: shm._REPLY_INLINE): the caller's slow path. */
static int put_entry(Taker *self, const char *data, uint64_t n) {
    uint64_t *q = self->q;
    uint64_t pos = __atomic_load_n(&q[self->rw_idx], __ATOMIC_RELAXED);
    uint64_t size = (8 + n + 7) & ~(uint64_t)7;
    uint64_t off = pos & (self->rring - 1);
    if (n > self->rring / 4 || off + size > self->rring ||
        pos + size - __atomic_load_n(&q[self->rr_idx], __ATOMIC_ACQUIRE) > self->rring)
        return -1;
    uint64_t *entry = (uint64_t *)(self->base + self->rbase + off);
    entry[0] = n;
    memcpy(entry + 1, data, n);
    __atomic_store_n(&q[self->rw_idx], pos + size, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&q[self->ctl_sleep_idx], __ATOMIC_RELAXED) ||
        __atomic_load_n(&q[self->ctl_async_idx], __ATOMIC_RELAXED))
        return wake_checked(self->ctl_efd) < 0 ? -2 : 0;  /* -2: published, OSError set */
    return 0;
}

static int replies_set(Taker *self) {
    if (released(self->q)) return 0;
    if (self->rring) return 1;
    PyErr_SetString(PyExc_RuntimeError, "replies() was not called");
    return 0;
}

/* put(data) -> True, or False with nothing written (put_entry's -1: the slow path). */
static PyObject *Taker_put(Taker *self, PyObject *data) {
    if (!replies_set(self)) return NULL;
    Py_buffer p;
    if (PyObject_GetBuffer(data, &p, PyBUF_SIMPLE) < 0) return NULL;
    int r = put_entry(self, p.buf, (uint64_t)p.len);
    PyBuffer_Release(&p);
    if (r == -2) return NULL;
    return PyBool_FromLong(r == 0);
}

/* put_plain(msg, version) -> put(marshal.dumps(msg, version)): a worker's reply of plain
 * values in one call. */
static PyObject *Taker_put_plain(Taker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put_plain takes 2 arguments");
        return NULL;
    }
    if (!replies_set(self)) return NULL;
    long version = PyLong_AsLong(args[1]);
    if (version == -1 && PyErr_Occurred()) return NULL;
    if (version < 0 || version > Py_MARSHAL_VERSION) {
        PyErr_Format(PyExc_ValueError, "put_plain: marshal version %ld is not one of 0..%d; "
                     "pass protocol.PLAIN", version, Py_MARSHAL_VERSION);
        return NULL;
    }
    PyObject *data = PyMarshal_WriteObjectToString(args[0], (int)version);
    if (!data) return NULL;
    int r = put_entry(self, PyBytes_AS_STRING(data), (uint64_t)PyBytes_GET_SIZE(data));
    Py_DECREF(data);
    if (r == -2) return NULL;
    return PyBool_FromLong(r == 0);
}

static PyMethodDef Taker_methods[] = {
    {"take", (PyCFunction)Taker_take, METH_O,
     "take(pos) -> (payload, new_pos) | (None, pos) | (False, pos)"},
    {"replies", (PyCFunction)Taker_replies, METH_VARARGS,
     "replies(rbase, ring_size, rw_idx, rr_idx, ctl_sleep_idx, ctl_async_idx, ctl_efd)"},
    {"put", (PyCFunction)Taker_put, METH_O,
     "put(data) -> True, or False with nothing written (wrap, full or large: slow path)"},
    {"put_plain", (PyCFunction)(void (*)(void))Taker_put_plain, METH_FASTCALL,
     "put_plain(msg, version) -> put(marshal.dumps(msg, version))"},
    {"release", (PyCFunction)Taker_release, METH_NOARGS,
     "release(): let go of the mapping; any use after raises ValueError"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "unison._ring.Taker",
    .tp_basicsize = sizeof(Taker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Taker(buffer, cmd_base, ring_size, rank_bit, read_idx, done_idx, "
              "ctl_done_idx, done_efd)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Taker_init,
    .tp_dealloc = (destructor)Taker_dealloc,
    .tp_methods = Taker_methods,
};

/* ---- the cancellation board's word of one worker (cancel.py) ------------------------------ */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *q;
    Py_ssize_t running;  /* word index of this worker's "running" word; "last" follows it */
    uint64_t table;      /* words in the table of cancelled ids (a power of two) */
} Mark;

static void Mark_dealloc(Mark *self) {
    if (self->view.obj) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Mark_init(Mark *self, PyObject *args, PyObject *kw) {
    PyObject *buf;
    Py_ssize_t running;
    unsigned long long table;
    if (!PyArg_ParseTuple(args, "OnK", &buf, &running, &table)) return -1;
    if (table == 0 || (table & (table - 1)) || running < (Py_ssize_t)table) {
        PyErr_SetString(PyExc_ValueError, "Mark: table must be a power of two below running");
        return -1;
    }
    if (self->view.obj) PyBuffer_Release(&self->view);
    self->q = NULL;
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) return -1;
    if ((running + 2) * 8 > self->view.len) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "Mark: the running and last words lie past the buffer");
        return -1;
    }
    self->q = (uint64_t *)self->view.buf;
    self->running = running;
    self->table = table;
    return 0;
}

/* enter(call_id) -> whether it is cancelled: running = call_id, then last = call_id (in that
 * order: the controller reads last, then running, to tell a call this worker is past); full
 * fence; then the table (the stores must not pass the load, or a post made meanwhile goes
 * unseen by both sides). */
static PyObject *Mark_enter(Mark *self, PyObject *arg) {
    if (!self->q) { PyErr_SetString(PyExc_ValueError, "the board is closed"); return NULL; }
    uint64_t id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    __atomic_store_n(&self->q[self->running], id, __ATOMIC_RELAXED);
    __atomic_store_n(&self->q[self->running + 1], id, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t posted = __atomic_load_n(&self->q[id & (self->table - 1)], __ATOMIC_RELAXED);
    return PyBool_FromLong(posted == id);
}

/* leave() -> whether the call it ran was cancelled: running = 0, then the table. A full
 * barrier between them (the exchange): a controller that saw the call running after its
 * post (cancel's "stuck") is sure to be seen here, so such a call ends cancelled even where
 * its signal was blocked or ignored. */
static PyObject *Mark_leave(Mark *self, PyObject *unused) {
    (void)unused;
    if (!self->q) { PyErr_SetString(PyExc_ValueError, "the board is closed"); return NULL; }
    uint64_t id = __atomic_exchange_n(&self->q[self->running], 0, __ATOMIC_SEQ_CST);
    uint64_t posted = __atomic_load_n(&self->q[id & (self->table - 1)], __ATOMIC_SEQ_CST);
    return PyBool_FromLong(id != 0 && posted == id);
}

/* close(): let go of the board's memory (its owner unmaps it next). */
static PyObject *Mark_close(Mark *self, PyObject *unused) {
    (void)unused;
    self->q = NULL;
    if (self->view.obj) PyBuffer_Release(&self->view);
    Py_RETURN_NONE;
}

static PyMethodDef Mark_methods[] = {
    {"enter", (PyCFunction)Mark_enter, METH_O,
     "enter(call_id) -> bool: say this worker runs call_id; whether it is cancelled"},
    {"leave", (PyCFunction)Mark_leave, METH_NOARGS,
     "leave() -> bool: this worker runs no call; whether the one it ran was cancelled"},
    {"close", (PyCFunction)Mark_close, METH_NOARGS, "close(): let go of the board's memory"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MarkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "unison._ring.Mark",
    .tp_basicsize = sizeof(Mark),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mark(buffer, running_index, table_size)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mark_init,
    .tp_dealloc = (destructor)Mark_dealloc,
    .tp_methods = Mark_methods,
};

/* fence(): a full memory barrier, for the Python sides' "store a word, then load another"
 * handshakes (channel/shm.py, cancel.py). One call: no signal's exception can land inside
 * it, as one can between a Python lock's acquire and release. */
static PyObject *fence(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"fence", fence, METH_NOARGS, "fence(): a full memory barrier"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "unison._ring",
    "The shm channel's command ring fast paths in C (see channel/shm.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&SenderType) < 0 || PyType_Ready(&TakerType) < 0 ||
        PyType_Ready(&MarkType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&SenderType);
    Py_INCREF(&TakerType);
    Py_INCREF(&MarkType);
    /* What this file hard-codes of shm.py's layout: _native.load compares them with shm.py's
       once, at import, and refuses a build made for another (where no .c lies beside it to
       tell a stale build, as in a wheel). */
    if (PyModule_AddIntConstant(m, "ENTRY", ENTRY) < 0 ||
        PyModule_AddIntConstant(m, "DESC", DESC) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WORKERS", MAX_WORKERS) < 0 ||
        PyModule_AddIntConstant(m, "FLAGS", FLAGS) < 0 ||
        PyModule_AddObject(m, "WRAP", PyLong_FromUnsignedLongLong(WRAP)) < 0 ||
        PyModule_AddIntConstant(m, "OK", STATUS_OK) < 0 ||
        PyModule_AddIntConstant(m, "ARRAY", STATUS_ARRAY) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE", UNISON_SOURCE) < 0 ||
        PyModule_AddObject(m, "Sender", (PyObject *)&SenderType) < 0 ||
        PyModule_AddObject(m, "Taker", (PyObject *)&TakerType) < 0 ||
        PyModule_AddObject(m, "Mark", (PyObject *)&MarkType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
