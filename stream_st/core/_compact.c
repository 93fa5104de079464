/* stream_st.core._compact: a header piece written as the reference writer writes it, read in C;
 * and a plain plan's header laid out in C (laid, below).
 *
 * piece(table, dtypes, max_ndim, plain_bits, text, first) -> (metadata, table(names, codes,
 * shapes, starts, ends), in_order) or None.
 *
 * ``text`` is a braced run of a header's members (see stream_st.core.header._compact_piece,
 * whose result this is). It is accepted only when it reads, byte for byte,
 *
 *     {["__metadata__":{"k":"v",...},]"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},...}
 *
 * followed by nothing but JSON whitespace; the metadata only where ``first`` is true, its keys
 * and values plain strings (no backslash, no control character, no key twice); a name holds no
 * quote, backslash or control character and is not "__metadata__"; numbers are plain JSON
 * integers below 2**64 (no sign, no leading zero); every dtype code is a key of ``dtypes``
 * (code -> (the table's own code string, bits per value)) of whole bytes; every shape has at
 * most ``max_ndim`` dimensions, none zero, and its bits (values x bits per value) are at most
 * ``plain_bits``; and each tensor's offsets span exactly its bytes. Those are the tensors every
 * check of the Python parse passes plainly: anything else (a valid header of another layout, an
 * empty tensor, a sub-byte dtype, or an invalid one) gives None, and the Python parse reads the
 * piece as before, which tells what is wrong. So this module only ever says yes where the
 * Python parse says the same yes, and it is optional: without it that parse reads every piece.
 *
 * ``table`` (stream_st.core.header.TensorTable) is called with the columns: ``names`` (str),
 * ``codes`` (the table's own strings), ``shapes`` (tuples of int; tensors of the same shape share
 * one tuple), ``starts`` and ``ends`` (int); ``in_order`` is whether each tensor starts where
 * the one before ends. Every read is bounds-checked against the text's length; the
 * text is the UTF-8 of a str, so a name's bytes decode.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_text.h"

typedef unsigned long long u64;

typedef struct {
    const char *s;
    Py_ssize_t n;
    Py_ssize_t i;
} Cursor;

/* The literal ``lit`` (of ``len`` bytes) at the cursor, consumed; 0 if not there. */
static int literal(Cursor *c, const char *lit, Py_ssize_t len) {
    if (c->n - c->i < len || memcmp(c->s + c->i, lit, (size_t)len) != 0) return 0;
    c->i += len;
    return 1;
}

#define LITERAL(c, lit) literal((c), (lit), (Py_ssize_t)(sizeof(lit) - 1))

/* A plain JSON integer below 2**64 at the cursor (0, or a digit 1-9 then digits), consumed
   into *out; 0 if there is none or it does not fit. */
static int number(Cursor *c, u64 *out) {
    Py_ssize_t i = c->i;
    if (i >= c->n || c->s[i] < '0' || c->s[i] > '9') return 0;
    u64 value = (u64)(c->s[i++] - '0');
    if (value != 0) {
        while (i < c->n && c->s[i] >= '0' && c->s[i] <= '9') {
            u64 digit = (u64)(c->s[i++] - '0');
            if (value > (UINT64_MAX - digit) / 10) return 0;
            value = value * 10 + digit;
        }
    }
    c->i = i;
    *out = value;
    return 1;
}

/* The bytes of a string's content at the cursor, up to its closing quote (consumed, the quote
   too): no backslash; with ``plain``, no control character either. Its span in *start, *len;
   0 if the text ends first or a refused byte comes. */
static int string_body(Cursor *c, int plain, Py_ssize_t *start, Py_ssize_t *len) {
    Py_ssize_t i = c->i;
    while (i < c->n) {
        unsigned char b = (unsigned char)c->s[i];
        if (b == '"') {
            *start = c->i;
            *len = i - c->i;
            c->i = i + 1;
            return 1;
        }
        if (b == '\\' || (plain && b < 0x20)) return 0;
        i++;
    }
    return 0;
}

/* A str of the text's span (valid UTF-8: the text is a str's); NULL with an exception set. */
static PyObject *span_str(Cursor *c, Py_ssize_t start, Py_ssize_t len) {
    return PyUnicode_DecodeUTF8(c->s + start, len, "strict");
}

/* The metadata object at the cursor (after "__metadata__":), plain strings only: a new dict;
   Py_None (a new reference) where it is not plain or holds a key twice; NULL on an error. */
static PyObject *metadata(Cursor *c) {
    if (!LITERAL(c, "{")) Py_RETURN_NONE;
    PyObject *dict = PyDict_New();
    if (dict == NULL) return NULL;
    if (LITERAL(c, "}")) return dict;
    for (;;) {
        Py_ssize_t ks, kl, vs, vl;
        if (!LITERAL(c, "\"") || !string_body(c, 1, &ks, &kl) || !LITERAL(c, ":\"") ||
            !string_body(c, 1, &vs, &vl))
            goto not_plain;
        PyObject *key = span_str(c, ks, kl);
        if (key == NULL) goto error;
        int twice = PyDict_Contains(dict, key);
        PyObject *value = twice == 0 ? span_str(c, vs, vl) : NULL;
        int stored = value != NULL ? PyDict_SetItem(dict, key, value) : -1;
        Py_DECREF(key);
        Py_XDECREF(value);
        if (twice == 1) goto not_plain;
        if (twice < 0 || stored < 0) goto error;
        if (LITERAL(c, "}")) return dict;
        if (!LITERAL(c, ",")) goto not_plain;
    }
not_plain:
    Py_DECREF(dict);
    Py_RETURN_NONE;
error:
    Py_DECREF(dict);
    return NULL;
}

/* The shape tuple of the dimensions written in text[start:start + len] ("2,3", or "" for a
   scalar), already checked by the caller: each a plain integer below 2**64. */
static PyObject *shape_tuple(Cursor *c, Py_ssize_t start, Py_ssize_t len, Py_ssize_t ndim) {
    PyObject *shape = PyTuple_New(ndim);
    if (shape == NULL) return NULL;
    Cursor dims = {c->s, start + len, start};
    for (Py_ssize_t d = 0; d < ndim; d++) {
        u64 dim = 0;
        (void)number(&dims, &dim); /* checked before */
        (void)LITERAL(&dims, ",");
        PyObject *item = PyLong_FromUnsignedLongLong(dim);
        if (item == NULL || PyTuple_SetItem(shape, d, item) < 0) {
            Py_DECREF(shape);
            return NULL;
        }
    }
    return shape;
}

typedef struct {
    PyObject *names, *codes, *shapes, *starts, *ends;
    PyObject *shape_cache; /* shape text -> tuple */
    /* The last member's dtype and shape, by their spans in the text. */
    Py_ssize_t code_start, code_len, shape_start, shape_len;
    PyObject *code; /* borrowed from dtypes */
    u64 code_bits;
    PyObject *shape; /* borrowed from shape_cache */
} Columns;

/* The table's code string and bits for text[start:start + len], from ``dtypes``; 0 where it is
   not there (or not of whole bytes), -1 on an error. */
static int dtype_of(Columns *t, PyObject *dtypes, Cursor *c, Py_ssize_t start, Py_ssize_t len) {
    if (t->code != NULL && len == t->code_len &&
        memcmp(c->s + start, c->s + t->code_start, (size_t)len) == 0)
        return 1;
    PyObject *key = span_str(c, start, len);
    if (key == NULL) return -1;
    PyObject *entry = PyDict_GetItemWithError(dtypes, key); /* borrowed */
    Py_DECREF(key);
    if (entry == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(entry) || PyTuple_Size(entry) != 2) return 0;
    PyObject *code = PyTuple_GetItem(entry, 0);
    u64 bits = PyLong_AsUnsignedLongLong(PyTuple_GetItem(entry, 1));
    if (bits == (u64)-1 && PyErr_Occurred()) return -1;
    if (code == NULL || bits == 0 || bits % 8 != 0) return 0;
    t->code = code;
    t->code_bits = bits;
    t->code_start = start;
    t->code_len = len;
    return 1;
}

/* The shared tuple of the shape written in text[start:start + len]; NULL on an error. */
static PyObject *shape_of(Columns *t, Cursor *c, Py_ssize_t start, Py_ssize_t len,
                          Py_ssize_t ndim) {
    if (t->shape != NULL && len == t->shape_len &&
        memcmp(c->s + start, c->s + t->shape_start, (size_t)len) == 0)
        return t->shape;
    PyObject *key = span_str(c, start, len);
    if (key == NULL) return NULL;
    PyObject *shape = PyDict_GetItemWithError(t->shape_cache, key); /* borrowed */
    if (shape == NULL && !PyErr_Occurred()) {
        PyObject *made = shape_tuple(c, start, len, ndim);
        if (made != NULL && PyDict_SetItem(t->shape_cache, key, made) == 0) shape = made;
        Py_XDECREF(made); /* the cache holds it */
    }
    Py_DECREF(key);
    if (shape != NULL) {
        t->shape = shape;
        t->shape_start = start;
        t->shape_len = len;
    }
    return shape;
}

static int append_u64(PyObject *list, u64 value) {
    PyObject *item = PyLong_FromUnsignedLongLong(value);
    if (item == NULL) return -1;
    int failed = PyList_Append(list, item);
    Py_DECREF(item);
    return failed;
}

/* One member at the cursor, appended to the columns: 1, 0 where it is not plain, -1 on an
   error. ``*previous_end`` is the end of the member before (or -1 for none) and becomes this
   one's; ``*in_order`` is cleared where this one does not start there. */
static int member(Columns *t, Cursor *c, PyObject *dtypes, Py_ssize_t max_ndim, u64 plain_bits,
                  u64 *previous_end, int *first_member, int *in_order) {
    Py_ssize_t ns, nl, cs, cl;
    if (!LITERAL(c, "\"") || !string_body(c, 1, &ns, &nl)) return 0;
    if (nl == 12 && memcmp(c->s + ns, "__metadata__", 12) == 0) return 0;
    if (!LITERAL(c, ":{\"dtype\":\"") || !string_body(c, 0, &cs, &cl)) return 0;
    if (!LITERAL(c, ",\"shape\":[")) return 0;
    Py_ssize_t shape_start = c->i, ndim = 0;
    u64 count = 1; /* the values so far: at most plain_bits */
    if (!LITERAL(c, "]")) {
        for (;;) {
            u64 dim;
            if (!number(c, &dim)) return 0;
            if (dim == 0 || count > plain_bits / dim) return 0; /* no empty tensor; bounded */
            count *= dim;
            ndim++;
            if (LITERAL(c, "]")) break;
            if (!LITERAL(c, ",")) return 0;
        }
    }
    Py_ssize_t shape_len = c->i - 1 - shape_start;
    u64 start, end;
    if (!LITERAL(c, ",\"data_offsets\":[") || !number(c, &start) || !LITERAL(c, ",") ||
        !number(c, &end) || !LITERAL(c, "]}"))
        return 0;
    if (ndim > max_ndim) return 0;
    int known = dtype_of(t, dtypes, c, cs, cl);
    if (known <= 0) return known;
    if (count > plain_bits / t->code_bits) return 0;
    if (end < start || end - start != count * t->code_bits / 8) return 0;
    if (!*first_member && start != *previous_end) *in_order = 0;
    *first_member = 0;
    *previous_end = end;
    PyObject *shape = shape_of(t, c, shape_start, shape_len, ndim);
    if (shape == NULL) return -1;
    PyObject *name = span_str(c, ns, nl);
    if (name == NULL) return -1;
    int failed = PyList_Append(t->names, name);
    Py_DECREF(name);
    if (failed || PyList_Append(t->codes, t->code) || PyList_Append(t->shapes, shape) ||
        append_u64(t->starts, start) || append_u64(t->ends, end))
        return -1;
    return 1;
}

static PyObject *piece(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6 || !PyDict_Check(args[1]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "piece(table, dtypes: dict, max_ndim, plain_bits, text: str, first)");
        return NULL;
    }
    PyObject *table = args[0], *dtypes = args[1];
    Py_ssize_t max_ndim = PyLong_AsSsize_t(args[2]);
    u64 plain_bits = PyLong_AsUnsignedLongLong(args[3]);
    int first = PyObject_IsTrue(args[5]);
    if (first < 0 || (max_ndim == -1 && PyErr_Occurred()) ||
        (plain_bits == (u64)-1 && PyErr_Occurred()))
        return NULL;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(args[4], &n);
    if (s == NULL) {
        /* A str holding a lone surrogate has no UTF-8: the Python parse refuses it. */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Cursor c = {s, n, 0};
    if (!LITERAL(&c, "{")) Py_RETURN_NONE;
    PyObject *meta = NULL;
    if (first && LITERAL(&c, "\"__metadata__\":")) {
        meta = metadata(&c);
        if (meta == NULL) return NULL;
        if (meta == Py_None || !LITERAL(&c, ",")) {
            Py_DECREF(meta);
            Py_RETURN_NONE; /* not plain, or no tensor after it: the Python parse reads it */
        }
    }
    Columns t = {0};
    t.names = PyList_New(0);
    t.codes = PyList_New(0);
    t.shapes = PyList_New(0);
    t.starts = PyList_New(0);
    t.ends = PyList_New(0);
    t.shape_cache = PyDict_New();
    PyObject *result = NULL;
    if (!t.names || !t.codes || !t.shapes || !t.starts || !t.ends || !t.shape_cache) goto done;
    u64 previous_end = 0;
    int first_member = 1, in_order = 1;
    for (;;) {
        int got = member(&t, &c, dtypes, max_ndim, plain_bits, &previous_end, &first_member,
                         &in_order);
        if (got < 0) goto done;
        if (got == 0) goto declined;
        if (LITERAL(&c, "}")) break;
        if (!LITERAL(&c, ",")) goto declined;
    }
    for (; c.i < c.n; c.i++) {
        char b = c.s[c.i];
        if (b != ' ' && b != '\t' && b != '\n' && b != '\r') goto declined;
    }
    PyObject *columns = PyObject_CallFunctionObjArgs(table, t.names, t.codes, t.shapes,
                                                     t.starts, t.ends, NULL);
    if (columns == NULL) goto done;
    result = Py_BuildValue("(OOO)", meta != NULL ? meta : Py_None, columns,
                           in_order ? Py_True : Py_False);
    Py_DECREF(columns);
    goto done;
declined:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(meta);
    Py_XDECREF(t.names);
    Py_XDECREF(t.codes);
    Py_XDECREF(t.shapes);
    Py_XDECREF(t.starts);
    Py_XDECREF(t.ends);
    Py_XDECREF(t.shape_cache);
    return result;
}

/* laid(rows, attrs, head, dtype_of, layout_of) -> (text, names, codes, shapes, starts, ends,
   positions) or None: the header of a plan laid out back to back, as
   stream_st.core.layout._laid_here lays it out in Python (see there), for plain plans only.

   ``rows`` is a list of the plan's rows, (name, dtype, shape) tuples, or of objects whose
   attributes named by ``attrs`` (a tuple of three str) are those (None: tuples). ``head`` is
   the header's first members, joined (the metadata's, or ""). The callbacks are the Python
   layout's, called as it calls them: ``dtype_of(name, dtype)`` (its DType, whose ``code`` is a
   str) for each row whose dtype object is not the row before's, and ``layout_of(name, DType,
   shape)`` (bytes, member text up to the offsets) for each distinct (code, shape); each raises
   what is wrong with that row, as there. Accepted only where every name is exactly a str that
   JSON writes as it is (no quote, backslash or control character, valid UTF-8), is not
   "__metadata__" and comes once, every row is a 3-tuple, every (code, shape) is looked up as
   a dict key without an error, and the data ends below 2**64: anything else gives None, and the
   Python layout lays the plan out, which tells what is wrong. Rows are checked in order, each
   name before its layout, as the Python layout checks them, so an error a callback raises is
   the one the Python layout raises first. */
typedef struct {
    PyObject *given, *dtype; /* the last row's dtype, as given and as found (held) */
    PyObject *code;          /* the found dtype's code (held) */
    PyObject *shape;         /* the last row's shape (held) */
    PyObject *entry;         /* its layout: (bytes, text), borrowed from the cache */
    u64 nbytes;
    const char *text;
    Py_ssize_t text_len;
} Layout;

/* Whether ``a`` and ``b`` are the same shape, where that can be told without calling code a
   caller defined: the same object, or tuples of exact ints equal item by item; else 0 (the
   cache then compares them, as the Python layout's dict does). */
static int same_shape(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b)) return 0;
    Py_ssize_t n = PyTuple_Size(a);
    if (PyTuple_Size(b) != n) return 0;
    for (Py_ssize_t d = 0; d < n; d++) {
        PyObject *x = PyTuple_GetItem(a, d), *y = PyTuple_GetItem(b, d);
        if (!PyLong_CheckExact(x) || !PyLong_CheckExact(y)) return 0;
        if (PyObject_RichCompareBool(x, y, Py_EQ) != 1) return 0; /* ints: no error */
    }
    return 1;
}

/* Hold ``value`` in ``*slot`` (a new reference), dropping what it held. */
static void hold(PyObject **slot, PyObject *value) {
    PyObject *old = *slot;
    *slot = Py_NewRef(value);
    Py_XDECREF(old);
}

/* The layout of ``given`` and ``shape`` (of tensor ``name``) in ``*last``: 1, 0 where it is not
   plain, -1 on an error (one a callback raised: the row's own). */
static int layout(PyObject *cache, PyObject *dtype_of, PyObject *layout_of, PyObject *name,
                  PyObject *given, PyObject *shape, Layout *last) {
    if (last->dtype == NULL || given != last->given) { /* as the Python layout's ``found`` */
        PyObject *dtype = PyObject_CallFunctionObjArgs(dtype_of, name, given, NULL);
        if (dtype == NULL) return -1;
        PyObject *code = PyObject_GetAttrString(dtype, "code");
        if (code == NULL || !PyUnicode_CheckExact(code)) {
            Py_DECREF(dtype);
            Py_XDECREF(code);
            PyErr_Clear();
            return 0;
        }
        hold(&last->given, given);
        hold(&last->dtype, dtype);
        hold(&last->code, code);
        Py_DECREF(dtype);
        Py_DECREF(code);
    } else if (last->entry != NULL && same_shape(shape, last->shape)) {
        return 1;
    }
    PyObject *key = PyTuple_Pack(2, last->code, shape);
    if (key == NULL) return -1;
    PyObject *entry = PyDict_GetItemWithError(cache, key); /* borrowed */
    if (entry == NULL && PyErr_Occurred()) { /* the shape's hash or == failed */
        Py_DECREF(key);
        PyErr_Clear(); /* the Python layout says what is wrong */
        return 0;
    }
    if (entry == NULL) {
        PyObject *made = PyObject_CallFunctionObjArgs(layout_of, name, last->dtype, shape, NULL);
        int stored = made != NULL ? PyDict_SetItem(cache, key, made) : -1;
        Py_XDECREF(made); /* the cache holds it */
        if (stored < 0) {
            Py_DECREF(key);
            return made != NULL ? (PyErr_Clear(), 0) : -1;
        }
        entry = made;
    }
    Py_DECREF(key);
    if (!PyTuple_Check(entry) || PyTuple_Size(entry) != 2) return 0;
    PyObject *nbytes = PyTuple_GetItem(entry, 0);
    if (!PyLong_Check(nbytes)) return 0;
    u64 size = PyLong_AsUnsignedLongLong(nbytes);
    if (size == (u64)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    const char *text = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(entry, 1), &last->text_len);
    if (text == NULL) {
        PyErr_Clear();
        return 0;
    }
    hold(&last->shape, shape);
    last->entry = entry;
    last->nbytes = size;
    last->text = text;
    return 1;
}

/* Sets ``list[i]`` to ``item`` (a new reference, stolen); -1 if ``item`` is NULL. */
static int set_new(PyObject *list, Py_ssize_t i, PyObject *item) {
    return item == NULL ? -1 : PyList_SetItem(list, i, item);
}

static int set_borrowed(PyObject *list, Py_ssize_t i, PyObject *item) {
    return PyList_SetItem(list, i, Py_NewRef(item));
}

/* The row of ``item`` in ``field`` (new references): the items of the item itself (a 3-tuple)
   where ``attrs`` is NULL, else its three attributes; 1, 0 where it is no such tuple, -1 on an
   error. */
static int row_of(PyObject *item, PyObject *attrs, PyObject *field[3]) {
    if (attrs == NULL && (!PyTuple_Check(item) || PyTuple_Size(item) != 3)) return 0;
    for (Py_ssize_t f = 0; f < 3; f++) {
        field[f] = attrs == NULL ? Py_NewRef(PyTuple_GetItem(item, f))
                                 : PyObject_GetAttr(item, PyTuple_GetItem(attrs, f));
        if (field[f] == NULL) return -1;
    }
    return 1;
}

static PyObject *laid(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    PyObject *attrs = nargs == 5 && args[1] != Py_None ? args[1] : NULL;
    if (nargs != 5 || !PyList_Check(args[0]) || !PyUnicode_Check(args[2]) ||
        (attrs != NULL && (!PyTuple_Check(attrs) || PyTuple_Size(attrs) != 3))) {
        PyErr_SetString(PyExc_TypeError,
                        "laid(rows: list, attrs, head: str, dtype_of, layout_of)");
        return NULL;
    }
    PyObject *rows = args[0];
    PyObject *dtype_of = args[3], *layout_of = args[4];
    Py_ssize_t head_len, n = PyList_Size(rows);
    const char *head = PyUnicode_AsUTF8AndSize(args[2], &head_len);
    if (head == NULL) { /* a lone surrogate: the Python layout refuses it */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *columns[5] = {NULL}; /* names, codes, shapes, starts, ends */
    PyObject *positions = PyDict_New(), *cache = PyDict_New(), *result = NULL;
    PyObject *field[3] = {NULL}; /* the row's name, dtype and shape */
    Text t = {0};
    Layout last = {0};
    for (int c = 0; c < 5; c++) columns[c] = PyList_New(n);
    for (int c = 0; c < 5; c++)
        if (columns[c] == NULL) goto done;
    if (positions == NULL || cache == NULL) goto done;
    if (!reserve(&t, (size_t)head_len + 2)) goto nomemory;
    put(&t, "{", 1);
    put(&t, head, (size_t)head_len);
    u64 offset = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_Size(rows)) goto declined; /* changed meanwhile (by a callback) */
        PyObject *item = Py_NewRef(PyList_GetItem(rows, i)); /* held: attrs run Python code */
        int plain = row_of(item, attrs, field);
        Py_DECREF(item);
        if (plain < 0) goto done;
        if (plain == 0) goto declined;
        PyObject *name = field[0], *given = field[1], *shape = field[2];
        if (!PyUnicode_CheckExact(name)) goto declined;
        Py_ssize_t name_len;
        const char *utf8 = PyUnicode_AsUTF8AndSize(name, &name_len);
        if (utf8 == NULL) {
            PyErr_Clear();
            goto declined;
        }
        if (!plain_name(utf8, name_len)) goto declined;
        PyObject *index = PyLong_FromSsize_t(i);
        int stored = index != NULL ? PyDict_SetItem(positions, name, index) : -1;
        Py_XDECREF(index);
        if (stored < 0) goto done;
        if (PyDict_Size(positions) != i + 1) goto declined; /* the name came before */
        int got = layout(cache, dtype_of, layout_of, name, given, shape, &last);
        if (got < 0) goto done;
        if (got == 0) goto declined;
        u64 end = offset + last.nbytes;
        if (end < offset) goto declined; /* past 2**64 - 1: the Python layout says so */
        /* ,"name":{...,"data_offsets":[offset,end]} (and the closing brace) */
        if (!reserve(&t, (size_t)name_len + (size_t)last.text_len + 2 * NUMBER_ROOM + 8))
            goto nomemory;
        if (i > 0 || head_len > 0) put(&t, ",", 1);
        put(&t, "\"", 1);
        put(&t, utf8, (size_t)name_len);
        put(&t, "\":", 2);
        put(&t, last.text, (size_t)last.text_len);
        put_number(&t, offset);
        put(&t, ",", 1);
        put_number(&t, end);
        put(&t, "]}", 2);
        if (set_borrowed(columns[0], i, name) || set_borrowed(columns[1], i, last.code) ||
            set_borrowed(columns[2], i, shape) ||
            set_new(columns[3], i, PyLong_FromUnsignedLongLong(offset)) ||
            set_new(columns[4], i, PyLong_FromUnsignedLongLong(end)))
            goto done;
        offset = end;
        for (int f = 0; f < 3; f++) Py_CLEAR(field[f]);
    }
    if (PyList_Size(rows) != n) goto declined; /* grown meanwhile (by a callback) */
    if (!reserve(&t, 1)) goto nomemory;
    put(&t, "}", 1);
    PyObject *text = PyBytes_FromStringAndSize(t.s, (Py_ssize_t)t.n);
    if (text == NULL) goto done;
    result = Py_BuildValue("(NOOOOOO)", text, columns[0], columns[1], columns[2], columns[3],
                           columns[4], positions);
    goto done;
nomemory:
    PyErr_NoMemory();
    goto done;
declined:
    result = Py_NewRef(Py_None);
done:
    for (int f = 0; f < 3; f++) Py_XDECREF(field[f]);
    for (int c = 0; c < 5; c++) Py_XDECREF(columns[c]);
    Py_XDECREF(positions);
    Py_XDECREF(cache);
    Py_XDECREF(last.given);
    Py_XDECREF(last.dtype);
    Py_XDECREF(last.code);
    Py_XDECREF(last.shape);
    PyMem_Free(t.s);
    return result;
}

/* untracked(list) -> list: ``list`` itself, no longer tracked by the cyclic garbage collector.
   For the columns of a big header's table, which hold only strings, integers, None and tuples
   of integers, none of which can refer back to the list: it can never be part of a reference
   cycle, and its million places are not walked by each collection of its generation. */
static PyObject *untracked(PyObject *module, PyObject *list) {
    (void)module;
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "untracked(list)");
        return NULL;
    }
    if (PyObject_GC_IsTracked(list)) PyObject_GC_UnTrack(list);
    return Py_NewRef(list);
}

static PyMethodDef methods[] = {
    {"untracked", untracked, METH_O,
     "untracked(list): the list, untracked by the garbage collector (see the module's source)."},
    {"laid", (PyCFunction)(void (*)(void))laid, METH_FASTCALL,
     "laid(rows, attrs, head, dtype_of, layout_of): the header text and columns of a plan laid out back "
     "to back, or None (see the module's source)."},
    {"piece", (PyCFunction)(void (*)(void))piece, METH_FASTCALL,
     "piece(table, dtypes, max_ndim, plain_bits, text, first): the table of a header piece "
     "written as the reference writer writes it, or None (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_compact",
    "A header piece in the reference writer's layout, read in C.", 0, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__compact(void) { return PyModule_Create(&module); }
