/* stream_st.core._small: a small file of numpy arrays written whole, in C.
 *
 * save(tensors, path, formats, ndarray, metadata, limit, block, max_header) -> True or None.
 *
 * The drop-ins' ``save_file`` of a few small arrays spends most of its time in Python's fixed
 * costs (the plan, the header, the temporary file's bookkeeping), several times the system
 * calls' own. This writes the file the Python write makes (stream_st.compat._save), byte for
 * byte, through the same nameless temporary file and commit, in one call, for the plain case
 * only:
 *
 * - ``tensors`` a dict of names (exactly str: a subclass may sort otherwise) to arrays of type
 *   exactly ``ndarray``, C-contiguous, each of a buffer format that is a key of ``formats``
 *   (format -> (dtype code, rank): the rank orders the tensors as the reference does,
 *   descending, then the names' code points); no name "__metadata__" or holding a quote, a
 *   backslash or a control character (which JSON escapes); their data at most ``limit`` bytes
 *   in all;
 * - ``path`` a str naming a local file with nothing there, or a regular file, which is
 *   replaced (the new file takes its permission bits, less set-user-ID and set-group-ID); no
 *   URL, nothing ending in "/";
 * - ``metadata`` the header's first member (``"__metadata__":{...}``, as the Python write
 *   makes it) or None; the header, padded, at most ``max_header`` bytes;
 * - a file system that gives a nameless file (``O_TMPFILE``) a name through ``/proc``.
 *
 * The data is written in calls that end at multiples of ``block`` bytes of the file, as the
 * Python write cuts them. Anything else, and any failure of a system call, gives None with
 * nothing left behind (the nameless file goes with its descriptor; a temporary name given is
 * removed), and the caller writes the file the Python way, which tells what is wrong. So this
 * module only ever writes what the Python write would, and it is optional: without it that
 * write makes every file. The GIL is held throughout (the data is small): nothing can change
 * the dict or the arrays meanwhile.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_text.h"

#if defined(O_TMPFILE) && defined(AT_SYMLINK_FOLLOW)
#define HAVE_NAMELESS 1
#else
#define HAVE_NAMELESS 0
#endif

#define MAX_IOV 1024 /* Linux's IOV_MAX, as the Python write's */

typedef struct {
    const char *name; /* UTF-8, owned by the str in the dict */
    Py_ssize_t name_len;
    const char *code;
    Py_ssize_t code_len;
    long rank;
    Py_buffer view;
} Row;

/* The reference's order: descending rank, then the names' code points (their UTF-8 bytes'
   order); names are distinct. */
static int by_reference(const void *a, const void *b) {
    const Row *x = a, *y = b;
    if (x->rank != y->rank) return x->rank > y->rank ? -1 : 1;
    Py_ssize_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, (size_t)n);
    if (c != 0) return c;
    return x->name_len < y->name_len ? -1 : 1;
}

/* Positioned write of ``iov[0..count)`` (``size`` bytes) at ``offset``, all of it; 0 on an
   error. */
static int write_fully(int fd, struct iovec *iov, int count, size_t size, off_t offset) {
    while (size > 0) {
        ssize_t written = pwritev(fd, iov, count, offset);
        if (written <= 0) return 0;
        offset += written;
        size -= (size_t)written;
        while (count > 0 && (size_t)written >= iov->iov_len) {
            written -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + written;
            iov->iov_len -= (size_t)written;
        }
    }
    return 1;
}

/* The pieces written back to back from offset 0, in calls that end at multiples of ``block``
   bytes of the file and take at most MAX_IOV pieces; 0 on an error. */
static int write_pieces(int fd, const char **bases, const size_t *lens, Py_ssize_t n,
                        size_t block) {
    struct iovec iov[MAX_IOV];
    int count = 0;
    size_t at = 0, end = 0, room = block;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t start = 0;
        while (start < lens[i]) {
            size_t take = lens[i] - start < room ? lens[i] - start : room;
            iov[count].iov_base = (void *)(bases[i] + start);
            iov[count].iov_len = take;
            count++;
            start += take;
            end += take;
            room -= take;
            if (room == 0 || count == MAX_IOV) {
                if (!write_fully(fd, iov, count, end - at, (off_t)at)) return 0;
                count = 0;
                at = end;
                if (room == 0) room = block;
            }
        }
    }
    return count == 0 || write_fully(fd, iov, count, end - at, (off_t)at);
}

/* The file's bytes written to a nameless file in ``directory`` and given the name ``path``
   (``replacing``: under a new hidden name, renamed over the file there, whose permission bits
   ``mode`` it takes); 0 (nothing left behind) on any failure. */
static int commit(const char *directory, const char *path, const char *base, int replacing,
                  mode_t mode, const char **bases, const size_t *lens, Py_ssize_t n,
                  size_t block) {
#if HAVE_NAMELESS
    size_t dir_len = strlen(directory), base_len = strlen(base);
    if (replacing && base_len + 18 > 255) return 0; /* the Python write names it otherwise */
    int fd = open(directory, O_RDWR | O_TMPFILE | O_CLOEXEC, 0666);
    if (fd < 0) return 0;
    if (replacing) (void)fchmod(fd, mode); /* a file system without them keeps the default */
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    int done = 0;
    if (!write_pieces(fd, bases, lens, n, block)) goto out;
    if (!replacing) {
        done = linkat(AT_FDCWD, proc, AT_FDCWD, path, AT_SYMLINK_FOLLOW) == 0;
        goto out;
    }
    /* ".<base>.<12 hex digits>.tmp" beside it, as the Python write names its temporary */
    char *temp = malloc(dir_len + base_len + 20);
    if (temp == NULL) goto out;
    for (int tries = 0; tries < 8 && !done; tries++) {
        unsigned char token[6];
        if (getrandom(token, sizeof token, 0) != (ssize_t)sizeof token) break;
        snprintf(temp, dir_len + base_len + 20, "%s/.%s.%02x%02x%02x%02x%02x%02x.tmp", directory,
                 base, token[0], token[1], token[2], token[3], token[4], token[5]);
        if (linkat(AT_FDCWD, proc, AT_FDCWD, temp, AT_SYMLINK_FOLLOW) == 0) {
            done = rename(temp, path) == 0;
            if (!done) (void)unlink(temp);
            break;
        }
        if (errno != EEXIST) break;
    }
    free(temp);
out:
    close(fd);
    return done;
#else
    (void)directory, (void)path, (void)base, (void)replacing, (void)mode, (void)bases,
        (void)lens, (void)n, (void)block;
    return 0;
#endif
}

static PyObject *save(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8 || !PyDict_Check(args[0]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "save(tensors, path, formats, ndarray, metadata, limit, block, "
                        "max_header)");
        return NULL;
    }
    PyObject *tensors = args[0], *formats = args[2], *ndarray = args[3], *metadata = args[4];
    size_t limit = PyLong_AsSize_t(args[5]);
    size_t block = PyLong_AsSize_t(args[6]);
    size_t max_header = PyLong_AsSize_t(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (block == 0) {
        PyErr_SetString(PyExc_ValueError, "block must be positive");
        return NULL;
    }
    if (!PyUnicode_Check(args[1])) Py_RETURN_NONE;
    Py_ssize_t path_len;
    const char *path = PyUnicode_AsUTF8AndSize(args[1], &path_len);
    if (path == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* A path the Python write looks into further (a URL, a directory's) or cannot name */
    if (path_len == 0 || path[path_len - 1] == '/' || strlen(path) != (size_t)path_len ||
        strstr(path, "://") != NULL)
        Py_RETURN_NONE;
    const char *metadata_text = NULL;
    Py_ssize_t metadata_len = 0;
    if (metadata != Py_None) {
        if (!PyUnicode_Check(metadata)) Py_RETURN_NONE;
        metadata_text = PyUnicode_AsUTF8AndSize(metadata, &metadata_len);
        if (metadata_text == NULL) { /* a lone surrogate: the Python write says so */
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }

    Py_ssize_t n = PyDict_Size(tensors), taken = 0;
    Row *rows = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Row));
    const char **bases = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    size_t *lens = PyMem_Calloc((size_t)n + 1, sizeof(size_t));
    Text text = {NULL, 0, 0};
    char *directory = NULL;
    PyObject *result = NULL;
    if (rows == NULL || bases == NULL || lens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *key, *value;
    Py_ssize_t position = 0;
    size_t data = 0;
    while (PyDict_Next(tensors, &position, &key, &value)) {
        if (taken >= n) goto declined; /* the dict grew: no longer the caller's */
        Row *row = &rows[taken];
        if (!PyUnicode_CheckExact(key) || Py_TYPE(value) != (PyTypeObject *)ndarray)
            goto declined;
        row->name = PyUnicode_AsUTF8AndSize(key, &row->name_len);
        if (row->name == NULL || !plain_name(row->name, row->name_len)) goto cleared;
        if (PyObject_GetBuffer(value, &row->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto cleared;
        taken++;
        PyObject *found =
            row->view.format == NULL ? NULL : PyDict_GetItemString(formats, row->view.format);
        if (found == NULL || !PyTuple_Check(found) || PyTuple_Size(found) != 2) goto declined;
        row->code = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(found, 0), &row->code_len);
        row->rank = PyLong_AsLong(PyTuple_GetItem(found, 1));
        if (row->code == NULL || PyErr_Occurred()) goto cleared;
        data += (size_t)row->view.len;
        if (data > limit) goto declined;
    }
    if (taken != n) goto declined; /* the dict changed size: no longer the caller's */
    qsort(rows, (size_t)n, sizeof(Row), by_reference);

    /* the header, as the Python write makes it: see stream_st.core.layout._header_of */
    size_t room = 8 + 1 + (size_t)metadata_len + 1 + 1 + 7; /* prefix, braces, comma, padding */
    for (Py_ssize_t i = 0; i < n; i++) /* each member: its name, code, dims and offsets */
        room += (size_t)rows[i].name_len + (size_t)rows[i].code_len + 48 +
                (size_t)(rows[i].view.ndim + 2) * (NUMBER_ROOM + 1);
    if (!reserve(&text, room)) {
        PyErr_NoMemory();
        goto done;
    }
    PUT(&text, "01234567{"); /* the length prefix's place, filled in below */
    if (metadata_text != NULL) {
        put(&text, metadata_text, (size_t)metadata_len);
        if (n > 0) PUT(&text, ",");
    }
    unsigned long long offset = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Row *row = &rows[i];
        if (i > 0) PUT(&text, ",");
        PUT(&text, "\"");
        put(&text, row->name, (size_t)row->name_len);
        PUT(&text, "\":{\"dtype\":\"");
        put(&text, row->code, (size_t)row->code_len);
        PUT(&text, "\",\"shape\":[");
        for (int d = 0; d < row->view.ndim; d++) {
            if (d > 0) PUT(&text, ",");
            put_number(&text, (unsigned long long)row->view.shape[d]);
        }
        PUT(&text, "],\"data_offsets\":[");
        put_number(&text, offset);
        PUT(&text, ",");
        put_number(&text, offset + (unsigned long long)row->view.len);
        PUT(&text, "]}");
        offset += (unsigned long long)row->view.len;
        bases[i + 1] = row->view.buf;
        lens[i + 1] = (size_t)row->view.len;
    }
    PUT(&text, "}");
    while ((text.n - 8) % 8 != 0) PUT(&text, " ");
    if (text.n - 8 > max_header) goto declined;
    unsigned long long header_size = text.n - 8;
    for (int b = 0; b < 8; b++) text.s[b] = (char)((header_size >> (8 * b)) & 0xff);
    bases[0] = text.s;
    lens[0] = text.n;

    /* the destination: nothing there, or a regular file */
    struct stat there;
    int replacing = 0;
    mode_t mode = 0;
    if (lstat(path, &there) == 0) {
        if (!S_ISREG(there.st_mode)) goto declined;
        replacing = 1;
        mode = there.st_mode & 07777 & ~(mode_t)(S_ISUID | S_ISGID);
    } else if (errno != ENOENT) {
        goto declined;
    }
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash == NULL ? 1 : (slash == path ? 1 : (size_t)(slash - path));
    directory = malloc(dir_len + 1);
    if (directory == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(directory, slash == NULL ? "." : path, dir_len);
    directory[dir_len] = '\0';
    const char *base = slash == NULL ? path : slash + 1;
    if (commit(directory, path, base, replacing, mode, bases, lens, n + 1, block)) {
        result = Py_NewRef(Py_True);
        goto done;
    }
    goto declined;
cleared:
    PyErr_Clear();
declined:
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < taken; i++) PyBuffer_Release(&rows[i].view);
    PyMem_Free(rows);
    PyMem_Free(bases);
    PyMem_Free(lens);
    PyMem_Free(text.s);
    free(directory);
    return result;
}

static PyMethodDef methods[] = {
    {"save", (PyCFunction)(void (*)(void))save, METH_FASTCALL,
     "save(tensors, path, formats, ndarray, metadata, limit, block, max_header): True once a "
     "small file of plain numpy arrays is written and in place, else None with nothing left "
     "(see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_small", "A small file of numpy arrays written whole, in C.", 0,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__small(void) { return PyModule_Create(&module); }
