/* The async send's two hot calls, compiled: the common submission and the batch wait.

   Each type here stands on a pybind engine class in place of the package's Python wrapper of one call and does
   only that wrapper's common case, the same work with the same result (an entry in the pending table, a RAW_ASYNC
   record on the recorder's queue), without a Python frame. Anything else goes to the Python wrapper it was made
   with, which handles every case: the compiled path decides before it calls the engine whether the call is
   its to take, so the engine is never called twice. otel_kvtransfer/engines/mooncake/compiled.py says when it is used;
   the Python path stays the reference (tests/project/test_backend_contract.py runs both). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stddef.h>
#include <time.h>

/* time.monotonic_ns() on Linux: CLOCK_MONOTONIC, the records' clock before clock.BASE is added */
/* The positions this part reads and builds, each declared once in Python: the pending entry
   (recording/pending.py, ENTRY_*), the RAW_ASYNC record (recording/records.py, ASYNC_*), the last engine's forms
   (engines/mooncake/forms.py). The module exports them as LAYOUT; tests/engines/test_compiled_layout.py fails when
   they differ from the Python declaration (compiled.layout()). */
#define ENTRY_START 0
#define ENTRY_BYTES 1
#define ENTRY_DESCRIPTORS 2
#define ENTRY_PEER 3
#define ENTRY_FORM 4
#define ENTRY_INFO 5
#define ENTRY_CONTEXT 6
#define ENTRY_POSTED 7
#define ENTRY_SIZE 8
#define ASYNC_KIND 0
#define ASYNC_START 1
#define ASYNC_DURATION 2
#define ASYNC_BYTES 3
#define ASYNC_DESCRIPTORS 4
#define ASYNC_PEER 5
#define ASYNC_RETURN_CODE 6
#define ASYNC_ERROR 7
#define ASYNC_FORM 8
#define ASYNC_CONTEXT 9
#define ASYNC_SEEN_RUNNING 10
#define ASYNC_POST 11
#define ASYNC_SIZE 12
#define FORMS_ENGINE 0

static inline long long
monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static PyObject *str_active, *str_queue, *str_capacity, *str_idle, *str_record, *str_append, *str_settings,
    *str_max_pending, *str_transfer_failed, *str_drop, *str_pending_full, *zero;

/* What a wrapper reads on every call and what it keeps of it between calls: id() of the last engine it saw, the
   recorder's settings and their bound of the pending table, the recorder's queue and its bound `append`. Each is
   checked against what is there now (a fork makes a new queue, start() new settings) and read again when not. */
typedef struct {
    void *engine;              /* compared only, never dereferenced: id() of whatever object is there now */
    PyObject *engine_id;
    PyObject *settings;
    Py_ssize_t limit;
    PyObject *queue;
    PyObject *append;
} Kept;

static void
kept_clear(Kept *kept)
{
    Py_CLEAR(kept->engine_id);
    Py_CLEAR(kept->settings);
    Py_CLEAR(kept->queue);
    Py_CLEAR(kept->append);
    kept->engine = NULL;
}

static int
kept_traverse(Kept *kept, visitproc visit, void *arg)
{
    Py_VISIT(kept->engine_id);
    Py_VISIT(kept->settings);
    Py_VISIT(kept->queue);
    Py_VISIT(kept->append);
    return 0;
}

/* id(engine): a new reference, NULL with an error set. The kept one is shared by every thread calling this
   wrapper (one per method of the class, so every engine's): another thread may replace it whenever this one runs
   Python code, so a caller owns what it is given, never borrows the kept one. */
static PyObject *
engine_id(Kept *kept, PyObject *engine)
{
    if (kept->engine_id == NULL || kept->engine != (void *)engine) {
        PyObject *made = PyLong_FromVoidPtr(engine);
        if (made == NULL)
            return NULL;
        Py_XSETREF(kept->engine_id, made);
        kept->engine = engine;
    }
    return Py_NewRef(kept->engine_id);
}

/* The record on the recorder's queue as `Recorder.record` would put it (its contract lets a wrapper append
   while there is room and the thread is awake); otherwise through `record` itself. 0, or -1 with an error set. */
static int
hand_over(Kept *kept, PyObject *recorder, PyObject *rec)
{
    PyObject *queue = PyObject_GetAttr(recorder, str_queue);
    if (queue == NULL)
        return -1;
    int room = -1;
    Py_ssize_t waiting = PyObject_Length(queue);
    PyObject *capacity = waiting < 0 ? NULL : PyObject_GetAttr(recorder, str_capacity);
    if (capacity != NULL) {
        Py_ssize_t most = PyLong_AsSsize_t(capacity);
        Py_DECREF(capacity);
        if (!(most == -1 && PyErr_Occurred())) {
            room = waiting < most;
            if (room) {
                PyObject *idle = PyObject_GetAttr(recorder, str_idle);
                int sleeping = idle == NULL ? -1 : PyObject_IsTrue(idle);
                Py_XDECREF(idle);
                room = sleeping < 0 ? -1 : !sleeping;
            }
        }
    }
    PyObject *done = NULL;
    if (room == 1 && kept->queue != queue) {  /* a queue not seen before: its append found once */
        PyObject *append = PyObject_GetAttr(queue, str_append);
        if (append == NULL)
            room = -1;
        else {
            Py_XSETREF(kept->append, append);
            Py_XSETREF(kept->queue, Py_NewRef(queue));
        }
    }
    if (room == 1) {  /* owned while it runs: the call may let another thread replace the kept one */
        PyObject *append = Py_NewRef(kept->append);
        done = PyObject_CallOneArg(append, rec);
        Py_DECREF(append);
    }
    else if (room == 0)
        done = PyObject_CallMethodOneArg(recorder, str_record, rec);
    Py_DECREF(queue);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* dict.pop(key, None): a new reference, Py_None when the key is absent, NULL with an error set. Public API only:
   one lookup where the interpreter has PyDict_Pop (3.13), a lookup and a deletion before (the wait's keys are
   tuples of exact ints, which hash and compare without running Python code). */
static PyObject *
pop_item(PyObject *dict, PyObject *key)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *found = NULL;
    if (PyDict_Pop(dict, key, &found) < 0)
        return NULL;
    return found == NULL ? Py_NewRef(Py_None) : found;
#else
    PyObject *found = PyDict_GetItemWithError(dict, key);  /* borrowed: owned before the deletion */
    if (found == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_INCREF(found);
    if (PyDict_DelItem(dict, key) < 0) {
        Py_DECREF(found);
        return NULL;
    }
    return found;
#endif
}

/* The sign of an engine's answer, an int in the common case: -1, 0 or 1; -2 with an error set. */
static int
sign_of(PyObject *value)
{
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow)
            return overflow;
        if (number == -1 && PyErr_Occurred())
            return -2;
        return (number > 0) - (number < 0);
    }
    int below = PyObject_RichCompareBool(value, zero, Py_LT);
    if (below != 0)
        return below < 0 ? -2 : -1;
    int equal = PyObject_RichCompareBool(value, zero, Py_EQ);
    return equal < 0 ? -2 : !equal;
}

/* A new tuple of `n` items, each a new reference given to it (NULL items: the tuple is not made, the rest
   released): Py_BuildValue's work without parsing its format on every call. */
static PyObject *
tuple_of(Py_ssize_t n, PyObject **items)
{
    PyObject *made = NULL;
    int complete = 1;
    for (Py_ssize_t i = 0; i < n; i++)
        complete = complete && items[i] != NULL;
    if (complete)
        made = PyTuple_New(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (made != NULL)
            PyTuple_SET_ITEM(made, i, items[i]);
        else
            Py_XDECREF(items[i]);
    }
    return made;
}

/* The exception being raised, normalised, with its traceback: a new reference, taken from the thread. */
static PyObject *
take_raised(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* `exc` (stolen) raised again on the thread. */
static void
give_raised(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* After a failed read before the engine is called: 1 when what is raised is no Exception (an interrupt: left
   raised for the caller, as in the Python wrapper, whose read would raise it before the engine's call); else
   cleared, 0. */
static int
interrupted(void)
{
    PyObject *exc = take_raised();
    if (exc != NULL && !PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_Exception)) {
        give_raised(exc);
        return 1;
    }
    Py_XDECREF(exc);
    return 0;
}

/* own_error(what): counted and logged by the package. The error being raised is made the handled exception
   while it runs (its log line reads sys.exc_info()), then cleared: nothing of it reaches the engine's caller.
   0; or -1 when what is raised is no Exception (KeyboardInterrupt, SystemExit): left raised, as the Python
   wrapper's `except Exception` lets it through, so Ctrl-C reaches the engine's caller. */
static int
own_error(PyObject *report, const char *what)
{
    PyObject *exc = take_raised();
    if (exc != NULL && !PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_Exception)) {
        give_raised(exc);
        return -1;
    }
    PyObject *saved_type, *saved, *saved_tb;
    PyErr_GetExcInfo(&saved_type, &saved, &saved_tb);
    if (exc != NULL)  /* steals the three */
        PyErr_SetExcInfo(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
    PyObject *done = PyObject_CallFunction(report, "s", what);
    PyObject *late = done == NULL ? take_raised() : NULL;  /* an interrupt may land in the report itself */
    Py_XDECREF(done);
    PyErr_SetExcInfo(saved_type, saved, saved_tb);
    if (late == NULL || PyObject_TypeCheck(late, (PyTypeObject *)PyExc_Exception)) {
        Py_XDECREF(late);
        return 0;
    }
    give_raised(late);
    return -1;
}

/* (bytes, descriptors) of a common call's last argument: a batch's list of lengths, or one length. */
static int
count_lengths(PyObject *length, int batch, PyObject **nbytes, Py_ssize_t *descriptors)
{
    if (!batch) {
        *descriptors = 1;
        *nbytes = PyLong_CheckExact(length) ? Py_NewRef(length) : PyNumber_Long(length);  /* int(), as Python */
        return *nbytes == NULL ? -1 : 0;
    }
    PyObject *seq = PySequence_Fast(length, "lengths are no sequence");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long long total = 0;
    Py_ssize_t i = 0;
    for (; i < n; i++) {  /* ints summed in C while no sum could overflow */
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item))
            break;
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || value < 0 || total > LLONG_MAX - value)
            break;
        total += value;
    }
    PyObject *sum = PyLong_FromLongLong(total);
    /* The rest as sum() adds them. An item's own __add__ or __radd__ may change the list: each item is owned
       while it is added and the length read anew, as sum()'s iterator does (the item array may have moved). */
    for (; sum != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        PyObject *next = PyNumber_Add(sum, item);
        Py_DECREF(item);
        Py_SETREF(sum, next);
    }
    Py_DECREF(seq);
    if (sum != NULL && !PyLong_CheckExact(sum)) {
        Py_SETREF(sum, PyNumber_Long(sum));
    }
    *nbytes = sum;
    *descriptors = n;
    return sum == NULL ? -1 : 0;
}

/* --- the common submission ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;        /* attributes (the patcher's mark) */
    PyObject *original;    /* the engine's own method */
    PyObject *fallback;    /* the Python wrapper: every call this one does not take */
    PyObject *refused;     /* refused(engine, its four arguments, start, batch_id): a submission the engine refused */
    PyObject *report;      /* own_error */
    PyObject *recorder;
    PyObject *context;     /* the current context, read without a Python frame */
    PyObject *entered;     /* integration.ENTERED: while its item is not 0 some thread is in a scope */
    PyObject *last;        /* the last engine's forms: [(weak reference, write form, read form)] */
    PyObject *waiting;     /* the pending table's entries */
    PyObject *reused;      /* PendingTransfers.reused: an id the engine handed out again while still in the table */
    PyObject *suppress;
    PyObject *suppress_plain;
    long long base;        /* clock.BASE */
    Py_ssize_t at;         /* where the forms tuple holds this op's form */
    int batch;
    Kept kept;
} Submission;

static int
Submission_traverse(Submission *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->fallback);
    Py_VISIT(self->refused);
    Py_VISIT(self->report);
    Py_VISIT(self->recorder);
    Py_VISIT(self->context);
    Py_VISIT(self->entered);
    Py_VISIT(self->last);
    Py_VISIT(self->waiting);
    Py_VISIT(self->reused);
    Py_VISIT(self->suppress);
    Py_VISIT(self->suppress_plain);
    return kept_traverse(&self->kept, visit, arg);
}

static int
Submission_clear(Submission *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->refused);
    Py_CLEAR(self->report);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->context);
    Py_CLEAR(self->entered);
    Py_CLEAR(self->last);
    Py_CLEAR(self->waiting);
    Py_CLEAR(self->reused);
    Py_CLEAR(self->suppress);
    Py_CLEAR(self->suppress_plain);
    kept_clear(&self->kept);
    return 0;
}

static void
Submission_dealloc(Submission *self)
{
    PyObject_GC_UnTrack(self);
    Submission_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1: some thread may be in a transfer scope, or the item is no int; 0: none is (ENTERED's item is 0) */
static int
scopes_entered(PyObject *entered)
{
    if (!PyList_CheckExact(entered) || PyList_GET_SIZE(entered) < 1)
        return 1;
    PyObject *depth = PyList_GET_ITEM(entered, 0);
    if (!PyLong_CheckExact(depth))
        return 1;
    long value = PyLong_AsLong(depth);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return value != 0;
}

/* 1: recording; 0: not; -1: error */
static int
is_active(PyObject *recorder)
{
    PyObject *active = PyObject_GetAttr(recorder, str_active);
    if (active == NULL)
        return -1;
    int on = PyObject_IsTrue(active);
    Py_DECREF(active);
    return on;
}

/* 1: inside suppress_instrumentation(); 0: not; -1: error */
static int
suppressed(PyObject *ctx, PyObject *key, PyObject *plain)
{
    if (PyDict_GET_SIZE(ctx) == 0)
        return 0;
    PyObject *flag = PyDict_GetItemWithError(ctx, key);  /* borrowed */
    if (flag == NULL && PyErr_Occurred())
        return -1;
    int on = flag == NULL ? 0 : PyObject_IsTrue(flag);
    if (on != 0)
        return on;
    flag = PyDict_GetItemWithError(ctx, plain);
    if (flag == NULL && PyErr_Occurred())
        return -1;
    return flag == NULL ? 0 : PyObject_IsTrue(flag);
}

/* Room in the pending table: 1, or 0 when it holds max_pending_async, -1 error */
static int
table_room(Kept *kept, PyObject *recorder, PyObject *waiting)
{
    PyObject *settings = PyObject_GetAttr(recorder, str_settings);
    if (settings == NULL)
        return -1;
    if (settings != kept->settings) {  /* settings are frozen: their bound read once an object */
        PyObject *most = PyObject_GetAttr(settings, str_max_pending);
        Py_ssize_t limit = most == NULL ? -1 : PyLong_AsSsize_t(most);
        Py_XDECREF(most);
        if (limit == -1 && PyErr_Occurred()) {
            Py_DECREF(settings);
            return -1;
        }
        Py_XSETREF(kept->settings, Py_NewRef(settings));
        kept->limit = limit;
    }
    Py_DECREF(settings);
    return PyDict_GET_SIZE(waiting) < kept->limit;
}

static PyObject *
Submission_vectorcall(Submission *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs != 5 || !PyDict_CheckExact(self->waiting))
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    int on = is_active(self->recorder);
    if (on <= 0) {
        if (on < 0 && interrupted())
            return NULL;
        return PyObject_Vectorcall(on == 0 ? self->original : self->fallback, args, nargsf, NULL);
    }
    PyObject *ctx = PyObject_CallNoArgs(self->context);
    if (ctx == NULL)
        return interrupted() ? NULL : PyObject_Vectorcall(self->fallback, args, nargsf, NULL);
    if (!PyDict_Check(ctx) || scopes_entered(self->entered)) {  /* a scope's submission, or no dict context */
        Py_DECREF(ctx);
        return PyObject_Vectorcall(self->fallback, args, nargsf, NULL);
    }
    int quiet = suppressed(ctx, self->suppress, self->suppress_plain);
    if (quiet != 0) {  /* inside suppress_instrumentation(): the engine alone */
        Py_DECREF(ctx);
        if (quiet < 0 && interrupted())
            return NULL;
        return PyObject_Vectorcall(quiet == 1 ? self->original : self->fallback, args, nargsf, NULL);
    }
    /* the forms of the last engine's calls, when this is that engine (else Python looks them up and keeps them) */
    PyObject *engine = args[0];
    PyObject *forms = PyList_CheckExact(self->last) && PyList_GET_SIZE(self->last) > 0
                          ? PyList_GET_ITEM(self->last, 0) : NULL;
    PyObject *named = NULL;
    if (forms != NULL && PyTuple_CheckExact(forms) && PyTuple_GET_SIZE(forms) > self->at) {
        Py_INCREF(forms);
        named = PyObject_CallNoArgs(PyTuple_GET_ITEM(forms, FORMS_ENGINE));
    }
    else
        forms = NULL;
    if (named != engine) {
        Py_XDECREF(named);
        Py_XDECREF(forms);
        Py_DECREF(ctx);
        if (PyErr_Occurred() && interrupted())
            return NULL;
        return PyObject_Vectorcall(self->fallback, args, nargsf, NULL);
    }
    Py_DECREF(named);
    PyObject *form = Py_NewRef(PyTuple_GET_ITEM(forms, self->at));  /* kept: a call may replace the forms */
    Py_DECREF(forms);

    long long start = monotonic_ns() + self->base;
    PyObject *batch_id = PyObject_Vectorcall(self->original, args, nargsf, NULL);
    long long posted = monotonic_ns() + self->base;
    if (batch_id == NULL) {  /* as the Python wrapper: a raising submission is the caller's to see */
        Py_DECREF(form);
        Py_DECREF(ctx);
        return NULL;
    }
    PyObject *nbytes = NULL, *key = NULL, *entry = NULL;
    Py_ssize_t descriptors = 0;
    int failed = PyObject_Not(batch_id);  /* Mooncake answers a failed submission with 0 or -1 */
    if (failed == 0) {
        int sign = sign_of(batch_id);
        failed = sign == -2 ? -1 : sign < 0;
    }
    if (failed < 0)
        goto error;
    if (failed) {
        PyObject *done = PyObject_CallFunction(self->refused, "OOOOOLO", engine, args[1], args[2], args[3], args[4],
                                               start, batch_id);
        if (done == NULL)
            goto error;
        Py_DECREF(done);
        goto out;
    }
    int room = table_room(&self->kept, self->recorder, self->waiting);
    if (room <= 0) {  /* a full table: the send is counted as dropped, as PendingTransfers.submit counts it */
        PyObject *done = room < 0 ? NULL : PyObject_CallMethodOneArg(self->recorder, str_drop, str_pending_full);
        if (done == NULL)
            goto error;
        Py_DECREF(done);
        goto out;
    }
    if (count_lengths(args[4], self->batch, &nbytes, &descriptors) < 0)
        goto error;
    key = tuple_of(2, (PyObject *[]){engine_id(&self->kept, engine), Py_NewRef(batch_id)});
    if (key == NULL)
        goto error;
    PyObject *fields[ENTRY_SIZE];
    fields[ENTRY_START] = PyLong_FromLongLong(start);
    fields[ENTRY_BYTES] = Py_NewRef(nbytes);
    fields[ENTRY_DESCRIPTORS] = PyLong_FromSsize_t(descriptors);
    fields[ENTRY_PEER] = Py_NewRef(args[1]);
    fields[ENTRY_FORM] = Py_NewRef(form);
    fields[ENTRY_INFO] = Py_NewRef(Py_None);
    fields[ENTRY_CONTEXT] = Py_NewRef(PyDict_GET_SIZE(ctx) ? ctx : Py_None);
    fields[ENTRY_POSTED] = PyLong_FromLongLong(posted);
    entry = tuple_of(ENTRY_SIZE, fields);
    if (entry == NULL)
        goto error;
    PyObject *earlier = PyDict_SetDefault(self->waiting, key, entry);  /* borrowed */
    if (earlier == NULL)
        goto error;
    if (earlier != entry) {  /* an id still in the table, handed out again: PendingTransfers.reused sorts it out */
        Py_INCREF(earlier);
        PyObject *done = PyObject_CallFunctionObjArgs(self->reused, key, earlier, entry, NULL);
        Py_DECREF(earlier);
        if (done == NULL)
            goto error;
        Py_DECREF(done);
    }
    goto out;
error:
    if (own_error(self->report, "record a Mooncake submission") < 0)
        Py_CLEAR(batch_id);  /* an interrupt: raised to the caller in place of the answer, as in Python */
out:
    Py_XDECREF(nbytes);
    Py_XDECREF(key);
    Py_XDECREF(entry);
    Py_DECREF(form);
    Py_DECREF(ctx);
    return batch_id;
}

static PyObject *
Submission_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static PyObject *
bind(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* A wrapper's fields are read without a reference of the call's own while it runs: made once, never re-made
   under a call in flight. 0, or -1 with an error set when `original` is set already. */
static int
made_once(PyObject *original)
{
    if (original == NULL)
        return 0;
    PyErr_SetString(PyExc_TypeError, "this wrapper is made once: make a new one");
    return -1;
}

static int
Submission_init(Submission *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", "fallback", "refused", "report", "recorder", "context", "entered", "last",
                            "waiting", "reused", "suppress", "suppress_plain", "base", "at", "batch", NULL};
    PyObject *original, *fallback, *refused, *report, *recorder, *context, *entered, *last, *waiting, *reused,
        *suppress, *plain;
    long long base;
    Py_ssize_t at;
    int batch;
    if (made_once(self->original))
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOO!OOOLnp", names, &original, &fallback, &refused,
                                     &report, &recorder, &context, &entered, &last, &PyDict_Type, &waiting,
                                     &reused, &suppress, &plain, &base, &at, &batch))
        return -1;
    Py_XSETREF(self->original, Py_NewRef(original));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    Py_XSETREF(self->refused, Py_NewRef(refused));
    Py_XSETREF(self->report, Py_NewRef(report));
    Py_XSETREF(self->recorder, Py_NewRef(recorder));
    Py_XSETREF(self->context, Py_NewRef(context));
    Py_XSETREF(self->entered, Py_NewRef(entered));
    Py_XSETREF(self->last, Py_NewRef(last));
    Py_XSETREF(self->waiting, Py_NewRef(waiting));
    Py_XSETREF(self->reused, Py_NewRef(reused));
    Py_XSETREF(self->suppress, Py_NewRef(suppress));
    Py_XSETREF(self->suppress_plain, Py_NewRef(plain));
    self->base = base;
    self->at = at;
    self->batch = batch;
    self->vectorcall = (vectorcallfunc)Submission_vectorcall;
    return 0;
}

static PyMemberDef Submission_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(Submission, original), READONLY, "the engine's own method"},
    {NULL}};

static PyGetSetDef Submission_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict},
    {NULL}};

static PyTypeObject SubmissionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtransfer.engines.mooncake._async_compiled.Submission",
    .tp_doc = "An engine's common async submission, timed and put in the pending table without a Python frame.",
    .tp_basicsize = sizeof(Submission),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Submission_init,
    .tp_dealloc = (destructor)Submission_dealloc,
    .tp_traverse = (traverseproc)Submission_traverse,
    .tp_clear = (inquiry)Submission_clear,
    .tp_call = Submission_call,
    .tp_descr_get = bind,
    .tp_vectorcall_offset = offsetof(Submission, vectorcall),
    .tp_dictoffset = offsetof(Submission, dict),
    .tp_members = Submission_members,
    .tp_getset = Submission_getset,
};

/* --- the batch wait -------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *original;
    PyObject *completed;   /* completed(engine, args, kwargs, rc): the Python wrapper's work after the call */
    PyObject *ended;       /* PendingTransfers.ended: an entry this one does not build the record of */
    PyObject *reclaim;     /* PendingTransfers.reclaim: an entry posted after the wait began (a reused id) */
    PyObject *report;
    PyObject *recorder;
    PyObject *waiting;     /* the pending table's entries */
    PyObject *seen;        /* handle -> when a poll last saw it running */
    PyObject *raw_async;   /* records.RAW_ASYNC */
    long long base;
    Kept kept;
} BatchWait;

static int
BatchWait_traverse(BatchWait *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->completed);
    Py_VISIT(self->ended);
    Py_VISIT(self->reclaim);
    Py_VISIT(self->report);
    Py_VISIT(self->recorder);
    Py_VISIT(self->waiting);
    Py_VISIT(self->seen);
    Py_VISIT(self->raw_async);
    return kept_traverse(&self->kept, visit, arg);
}

static int
BatchWait_clear(BatchWait *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->completed);
    Py_CLEAR(self->ended);
    Py_CLEAR(self->reclaim);
    Py_CLEAR(self->report);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->waiting);
    Py_CLEAR(self->seen);
    Py_CLEAR(self->raw_async);
    kept_clear(&self->kept);
    return 0;
}

static void
BatchWait_dealloc(BatchWait *self)
{
    PyObject_GC_UnTrack(self);
    BatchWait_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The send of one ended entry: its RAW_ASYNC record built here (PendingTransfers.ended's common case), or by
   `_ended` itself for an entry of a scope (it carries the request's info). 0, or -1 with an error set. */
static int
end_entry(BatchWait *self, PyObject *entry, PyObject *handle, long long end, PyObject *rc, PyObject *error)
{
    PyObject *running = Py_None;  /* when a poll last saw it running; popped from the table as it ends */
    PyObject *popped = NULL;
    if (PyDict_GET_SIZE(self->seen)) {
        popped = PyDict_GetItemWithError(self->seen, handle);
        if (popped == NULL && PyErr_Occurred())
            return -1;
        if (popped != NULL) {
            Py_INCREF(popped);
            if (PyDict_DelItem(self->seen, handle) < 0) {
                Py_DECREF(popped);
                return -1;
            }
            running = popped;
        }
    }
    PyObject *rec;
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != ENTRY_SIZE
        || PyTuple_GET_ITEM(entry, ENTRY_INFO) != Py_None) {
        PyObject *done = PyObject_CallFunction(self->ended, "OLOOO", entry, end, running, rc, error);
        Py_XDECREF(popped);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
        return 0;
    }
    /* records.raw_async: the start on the records' clock, the other times in ns from it */
    PyObject **held = ((PyTupleObject *)entry)->ob_item;
    long long start = PyLong_AsLongLong(held[ENTRY_START]);
    long long seen = running == Py_None ? 0 : PyLong_AsLongLong(running);
    long long posted = held[ENTRY_POSTED] == Py_None ? 0 : PyLong_AsLongLong(held[ENTRY_POSTED]);
    Py_XDECREF(popped);
    if (PyErr_Occurred())
        return -1;
    PyObject *fields[ASYNC_SIZE];
    fields[ASYNC_KIND] = Py_NewRef(self->raw_async);
    fields[ASYNC_START] = Py_NewRef(held[ENTRY_START]);
    fields[ASYNC_DURATION] = PyLong_FromLongLong(end - start);
    fields[ASYNC_BYTES] = Py_NewRef(held[ENTRY_BYTES]);
    fields[ASYNC_DESCRIPTORS] = Py_NewRef(held[ENTRY_DESCRIPTORS]);
    fields[ASYNC_PEER] = Py_NewRef(held[ENTRY_PEER]);
    fields[ASYNC_RETURN_CODE] = Py_NewRef(rc);
    fields[ASYNC_ERROR] = Py_NewRef(error);
    fields[ASYNC_FORM] = Py_NewRef(held[ENTRY_FORM]);
    fields[ASYNC_CONTEXT] = Py_NewRef(held[ENTRY_CONTEXT]);
    fields[ASYNC_SEEN_RUNNING] = running == Py_None ? Py_NewRef(Py_None) : PyLong_FromLongLong(seen - start);
    fields[ASYNC_POST] = held[ENTRY_POSTED] == Py_None ? Py_NewRef(Py_None) : PyLong_FromLongLong(posted - start);
    rec = tuple_of(ASYNC_SIZE, fields);
    if (rec == NULL)
        return -1;
    int done = hand_over(&self->kept, self->recorder, rec);
    Py_DECREF(rec);
    return done;
}

/* The common wait's ids, as a tuple of their own (the list is the caller's to change while sends end): a new
   reference; NULL, without an error, for any other shape (Python's). Ids and answer exact ints: hashing and
   comparing them runs no Python code. */
static PyObject *
common_ids(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject *rc)
{
    if (kwnames != NULL || nargs != 2 || !PyList_CheckExact(args[1]) || !PyLong_CheckExact(rc))
        return NULL;
    PyObject *ids = PyList_AsTuple(args[1]);
    if (ids == NULL) {
        PyErr_Clear();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ids); i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(ids, i))) {
            Py_DECREF(ids);
            return NULL;
        }
    return ids;
}

/* 1 when the entry was posted after `called`: no send of a wait that began then (the engine freed its id in
   that wait and handed it out again before the wait returned) */
static int
posted_after(PyObject *entry, long long called)
{
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != ENTRY_SIZE
        || !PyLong_CheckExact(PyTuple_GET_ITEM(entry, ENTRY_POSTED)))
        return 0;
    long long posted = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, ENTRY_POSTED));
    if (posted == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return posted > called;
}

/* The common wait's sends ended: 0, or -1 with an error set. Every object it holds across the Python code an
   entry's end may run (PendingTransfers.ended, Recorder.record, PendingTransfers.reclaim) is its own. */
static int
end_common(BatchWait *self, PyObject *engine, PyObject *ids, PyObject *rc, long long called)
{
    long long end = monotonic_ns() + self->base;
    int done = PyObject_RichCompareBool(rc, zero, Py_EQ);  /* 0: every batch done */
    if (done < 0)
        return -1;
    PyObject *error = done ? Py_None : str_transfer_failed;
    PyObject *id = engine_id(&self->kept, engine);
    if (id == NULL)
        return -1;
    int failed = 0;
    for (Py_ssize_t i = 0; !failed && i < PyTuple_GET_SIZE(ids); i++) {
        PyObject *handle = PyTuple_Pack(2, id, PyTuple_GET_ITEM(ids, i));
        PyObject *entry = handle == NULL ? NULL : pop_item(self->waiting, handle);
        failed = entry == NULL;
        if (!failed && entry != Py_None) {
            if (posted_after(entry, called)) {
                PyObject *back = PyObject_CallFunction(self->reclaim, "OOLOO", handle, entry, end, rc, error);
                failed = back == NULL;
                Py_XDECREF(back);
            }
            else
                failed = end_entry(self, entry, handle, end, rc, error) < 0;
        }
        Py_XDECREF(entry);
        Py_XDECREF(handle);
    }
    Py_DECREF(id);
    return failed ? -1 : 0;
}

/* Any other shape of wait: the Python wrapper's work after the call. 0, or -1 with an error set. */
static int
end_other(BatchWait *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject *rc,
          long long called)
{
    PyObject *given = PyTuple_New(nargs - 1 > 0 ? nargs - 1 : 0);
    PyObject *named = PyDict_New();
    PyObject *done = NULL;
    if (given != NULL && named != NULL) {
        for (Py_ssize_t i = 1; i < nargs; i++)
            PyTuple_SET_ITEM(given, i - 1, Py_NewRef(args[i]));
        Py_ssize_t keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
        int ok = 0;
        for (Py_ssize_t i = 0; i < keywords && ok == 0; i++)
            ok = PyDict_SetItem(named, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]);
        if (ok == 0)
            done = PyObject_CallFunction(self->completed, "OOOOL", nargs ? args[0] : Py_None, given, named, rc,
                                         called);
    }
    Py_XDECREF(given);
    Py_XDECREF(named);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static PyObject *
BatchWait_vectorcall(BatchWait *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    long long called = monotonic_ns() + self->base;
    PyObject *rc = PyObject_Vectorcall(self->original, args, nargsf, kwnames);  /* blocks until the batches end */
    if (rc == NULL || !PyDict_GET_SIZE(self->waiting))
        return rc;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *ids = common_ids(args, nargs, kwnames, rc);
    int failed = ids == NULL ? end_other(self, args, nargs, kwnames, rc, called)
                             : end_common(self, args[0], ids, rc, called);
    Py_XDECREF(ids);
    if (failed && own_error(self->report, "observe a Mooncake completion") < 0)
        Py_CLEAR(rc);  /* an interrupt: raised to the caller in place of the answer, as in Python */
    return rc;
}

static int
BatchWait_init(BatchWait *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", "completed", "ended", "reclaim", "report", "recorder", "waiting", "seen",
                            "raw_async", "base", NULL};
    PyObject *original, *completed, *ended, *reclaim, *report, *recorder, *waiting, *seen, *raw_async;
    long long base;
    if (made_once(self->original))
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOO!O!OL", names, &original, &completed, &ended, &reclaim,
                                     &report, &recorder, &PyDict_Type, &waiting, &PyDict_Type, &seen, &raw_async,
                                     &base))
        return -1;
    Py_XSETREF(self->original, Py_NewRef(original));
    Py_XSETREF(self->completed, Py_NewRef(completed));
    Py_XSETREF(self->ended, Py_NewRef(ended));
    Py_XSETREF(self->reclaim, Py_NewRef(reclaim));
    Py_XSETREF(self->report, Py_NewRef(report));
    Py_XSETREF(self->recorder, Py_NewRef(recorder));
    Py_XSETREF(self->waiting, Py_NewRef(waiting));
    Py_XSETREF(self->seen, Py_NewRef(seen));
    Py_XSETREF(self->raw_async, Py_NewRef(raw_async));
    self->base = base;
    self->vectorcall = (vectorcallfunc)BatchWait_vectorcall;
    return 0;
}

static PyMemberDef BatchWait_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(BatchWait, original), READONLY, "the engine's own method"},
    {NULL}};

static PyTypeObject BatchWaitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_kvtransfer.engines.mooncake._async_compiled.BatchWait",
    .tp_doc = "An engine's batch wait, ending the pending table's sends it saw end without a Python frame.",
    .tp_basicsize = sizeof(BatchWait),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BatchWait_init,
    .tp_dealloc = (destructor)BatchWait_dealloc,
    .tp_traverse = (traverseproc)BatchWait_traverse,
    .tp_clear = (inquiry)BatchWait_clear,
    .tp_call = Submission_call,
    .tp_descr_get = bind,
    .tp_vectorcall_offset = offsetof(BatchWait, vectorcall),
    .tp_dictoffset = offsetof(BatchWait, dict),
    .tp_members = BatchWait_members,
    .tp_getset = Submission_getset,
};

/* The module's one-time set-up (multi-phase initialisation). The types are static and the interned names global:
   the wrappers stand on one engine class of one interpreter, so the module says it runs in the main interpreter
   only, and with the GIL: a wrapper's kept state (the last engine's id, the queue's append, the settings' bound)
   is read and replaced without a lock of its own. */
/* LAYOUT: the positions above by their Python names, for the test that holds them to the Python declaration. */
static int
add_layout(PyObject *m)
{
#define POSITION(name) {#name, name}
    struct { const char *name; long value; } positions[] = {
        POSITION(ENTRY_START), POSITION(ENTRY_BYTES), POSITION(ENTRY_DESCRIPTORS), POSITION(ENTRY_PEER),
        POSITION(ENTRY_FORM), POSITION(ENTRY_INFO), POSITION(ENTRY_CONTEXT), POSITION(ENTRY_POSTED),
        POSITION(ENTRY_SIZE), POSITION(ASYNC_KIND), POSITION(ASYNC_START), POSITION(ASYNC_DURATION),
        POSITION(ASYNC_BYTES), POSITION(ASYNC_DESCRIPTORS), POSITION(ASYNC_PEER), POSITION(ASYNC_RETURN_CODE),
        POSITION(ASYNC_ERROR), POSITION(ASYNC_FORM), POSITION(ASYNC_CONTEXT), POSITION(ASYNC_SEEN_RUNNING), POSITION(ASYNC_POST),
        POSITION(ASYNC_SIZE), POSITION(FORMS_ENGINE)};
#undef POSITION
    PyObject *layout = PyDict_New();
    if (layout == NULL)
        return -1;
    for (size_t i = 0; i < sizeof positions / sizeof positions[0]; i++) {
        PyObject *value = PyLong_FromLong(positions[i].value);
        int failed = value == NULL || PyDict_SetItemString(layout, positions[i].name, value) < 0;
        Py_XDECREF(value);
        if (failed) {
            Py_DECREF(layout);
            return -1;
        }
    }
    int done = PyModule_AddObjectRef(m, "LAYOUT", layout);
    Py_DECREF(layout);
    return done;
}

static int
module_exec(PyObject *m)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&str_active, "active"}, {&str_queue, "queue"}, {&str_capacity, "capacity"}, {&str_idle, "idle"},
        {&str_record, "record"}, {&str_append, "append"}, {&str_settings, "settings"},
        {&str_max_pending, "max_pending_async"}, {&str_transfer_failed, "transfer_failed"}, {&str_drop, "drop"},
        {&str_pending_full, "async_pending_full"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL)
        return -1;
    if (PyType_Ready(&SubmissionType) < 0 || PyType_Ready(&BatchWaitType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "Submission", (PyObject *)&SubmissionType) < 0 ||
        PyModule_AddObjectRef(m, "BatchWait", (PyObject *)&BatchWaitType) < 0)
        return -1;
    return add_layout(m);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_async_compiled",
    "The async send's common submission and batch wait, compiled (otel_kvtransfer.engines.mooncake.compiled).", 0, NULL,
    module_slots};

PyMODINIT_FUNC
PyInit__async_compiled(void)
{
    return PyModuleDef_Init(&module);
}
