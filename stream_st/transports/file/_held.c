/* stream_st.transports.file._held: what a local file's reader holds, let go in C.
 *
 * map(fd, size, flags, prot) -> Mapping: ``size`` bytes of file ``fd`` mapped (``mmap`` with
 * ``flags`` and ``prot``), holding no descriptor. A Mapping is a buffer (read-only unless
 * ``prot`` has PROT_WRITE) whose ``madvise(advice, start, length)`` advises a part of it (the
 * GIL released: MADV_POPULATE_READ reads the disk), and it unmaps the bytes when the last view
 * of it is gone.
 *
 * descriptor(fd) -> Descriptor: ``fd`` held, closed when the Descriptor is gone (or by its
 * ``close()``); ``fileno()`` gives it. Called on what ``os.open`` returns from C code (``map``
 * over ``map``), no Python step comes between the open and the hold.
 *
 * Python before 3.13 keeps a duplicate descriptor for each ``mmap.mmap``, so the readers map
 * files with the C library's ``mmap`` (stream_st.transports.file.mmap). Freed by a
 * ``weakref.finalize``, such a mapping (or a ``backend="pread"`` handle's descriptor) stayed for
 * the life of the process where a Ctrl-C landed as the finalizer began, and the Ctrl-C was lost
 * ("Exception ignored in: <finalize object ...>"): a finalizer is Python code, which a signal
 * handler can interrupt. A type's deallocation here runs no Python code, so nothing can
 * interrupt it, and the interrupt is raised in the caller as usual. (It also costs a fraction of
 * the ctypes call and the finalizer: a small file's load_file takes microseconds less.)
 *
 * Optional, as the other compiled modules: without it the Python fallback maps with ctypes and
 * frees with a finalizer, as before. The stable ABI of Python 3.11 (Py_buffer and the buffer
 * slots are part of it from then on); POSIX only.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    void *address;
    Py_ssize_t size;
    int readonly;
} Mapping;

typedef struct {
    PyObject_HEAD
    int fd;
} Descriptor;

static PyObject *MappingType, *DescriptorType;

/* Frees ``self`` as a heap type's instance (the type holds a reference per instance). */
static void release_object(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self);
    Py_DECREF(type);
}

static void mapping_dealloc(PyObject *self) {
    Mapping *mapping = (Mapping *)self;
    if (mapping->address != NULL) munmap(mapping->address, (size_t)mapping->size);
    release_object(self);
}

/* Each view holds a reference to the Mapping (PyBuffer_FillInfo takes one), so no view
   outlives the bytes. */
static int mapping_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    Mapping *mapping = (Mapping *)self;
    return PyBuffer_FillInfo(view, self, mapping->address, mapping->size, mapping->readonly,
                             flags);
}

static PyObject *mapping_madvise(PyObject *self, PyObject *args) {
    Mapping *mapping = (Mapping *)self;
    int advice;
    Py_ssize_t start, length;
    if (!PyArg_ParseTuple(args, "inn:madvise", &advice, &start, &length)) return NULL;
    if (start < 0 || length < 0 || start >= mapping->size) {
        PyErr_SetString(PyExc_ValueError, "madvise: the range is not within the mapping");
        return NULL;
    }
    if (length > mapping->size - start) length = mapping->size - start; /* as mmap.mmap's */
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = madvise((char *)mapping->address + start, (size_t)length, advice);
    Py_END_ALLOW_THREADS
    if (failed != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef mapping_methods[] = {
    {"madvise", mapping_madvise, METH_VARARGS,
     "madvise(advice, start, length): madvise() over length bytes from start."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mapping_slots[] = {
    {Py_tp_dealloc, mapping_dealloc},
    {Py_bf_getbuffer, mapping_getbuffer},
    {Py_tp_methods, mapping_methods},
    {Py_tp_doc, "A file's bytes mapped, unmapped when the last view of them is gone."},
    {0, NULL},
};

static PyType_Spec mapping_spec = {
    "stream_st.transports.file._held.Mapping", sizeof(Mapping), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    mapping_slots,
};

static PyObject *map(PyObject *module, PyObject *args) {
    (void)module;
    int fd, flags, prot;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "inii:map", &fd, &size, &flags, &prot)) return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "map: the size must be positive");
        return NULL;
    }
    Mapping *mapping = PyObject_New(Mapping, (PyTypeObject *)MappingType);
    if (mapping == NULL) return NULL;
    mapping->address = NULL;
    mapping->size = size;
    mapping->readonly = (prot & PROT_WRITE) == 0;
    void *address;
    Py_BEGIN_ALLOW_THREADS
    address = mmap(NULL, (size_t)size, prot, flags, fd, 0);
    Py_END_ALLOW_THREADS
    if (address == MAP_FAILED) {
        int error = errno; /* before the object's release, which may set it */
        Py_DECREF(mapping);
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    mapping->address = address;
    return (PyObject *)mapping;
}

static void descriptor_dealloc(PyObject *self) {
    Descriptor *held = (Descriptor *)self;
    if (held->fd >= 0) close(held->fd);
    release_object(self);
}

static PyObject *descriptor_fileno(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(((Descriptor *)self)->fd);
}

static PyObject *descriptor_close(PyObject *self, PyObject *unused) {
    (void)unused;
    Descriptor *held = (Descriptor *)self;
    if (held->fd >= 0) {
        int fd = held->fd;
        held->fd = -1;
        close(fd);
    }
    Py_RETURN_NONE;
}

static PyMethodDef descriptor_methods[] = {
    {"fileno", descriptor_fileno, METH_NOARGS, "fileno(): the descriptor held (-1 once closed)."},
    {"close", descriptor_close, METH_NOARGS, "close(): close the descriptor now (once)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot descriptor_slots[] = {
    {Py_tp_dealloc, descriptor_dealloc},
    {Py_tp_methods, descriptor_methods},
    {Py_tp_doc, "A descriptor held, closed when this is gone."},
    {0, NULL},
};

static PyType_Spec descriptor_spec = {
    "stream_st.transports.file._held.Descriptor", sizeof(Descriptor), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    descriptor_slots,
};

static PyObject *descriptor(PyObject *module, PyObject *args) {
    (void)module;
    int fd;
    if (!PyArg_ParseTuple(args, "i:descriptor", &fd)) return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "descriptor: not a descriptor");
        return NULL;
    }
    Descriptor *held = PyObject_New(Descriptor, (PyTypeObject *)DescriptorType);
    if (held == NULL) return NULL;
    held->fd = fd;
    return (PyObject *)held;
}

static PyMethodDef methods[] = {
    {"map", map, METH_VARARGS,
     "map(fd, size, flags, prot): size bytes of fd mapped, unmapped when the last view is gone."},
    {"descriptor", descriptor, METH_VARARGS,
     "descriptor(fd): fd held, closed when the object returned is gone."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_held", "What a local file's reader holds, let go in C.", 0,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__held(void) {
    if (MappingType == NULL) MappingType = PyType_FromSpec(&mapping_spec);
    if (DescriptorType == NULL) DescriptorType = PyType_FromSpec(&descriptor_spec);
    if (MappingType == NULL || DescriptorType == NULL) return NULL;
    PyObject *created = PyModule_Create(&module);
    if (created == NULL) return NULL;
    if (PyModule_AddObjectRef(created, "Mapping", MappingType) < 0 ||
        PyModule_AddObjectRef(created, "Descriptor", DescriptorType) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
