/* The page-hash chain loop in C: h_i = H(h_{i-1} || page_i), canonical big-endian digests.
 *
 * NOTE: this file carries no hash implementation. `bind` receives the address of the
 * XXH3_128bits function that the `xxhash` package's own extension already exports; the
 * Python side (pd_cache/core/hashing.py) checks this loop against the pure-Python chain at
 * import and falls back to it if the two ever disagree or this module is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct { uint64_t low64; uint64_t high64; } hash128_t;
typedef hash128_t (*hash128_fn)(const void *data, size_t len);

static hash128_fn xxh3_128 = NULL;

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) { out[i] = (unsigned char)(v & 0xff); v >>= 8; }
}

static PyObject *bind(PyObject *self, PyObject *arg) {
    unsigned long long address = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    xxh3_128 = (hash128_fn)(uintptr_t)address;
    Py_RETURN_NONE;
}

/* chain_xxh3_128(prior: bytes[16], data: buffer, page_bytes: int) -> list[bytes[16]] */
static PyObject *chain_xxh3_128(PyObject *self, PyObject *args) {
    Py_buffer prior, data;
    Py_ssize_t page_bytes;
    if (!PyArg_ParseTuple(args, "y*y*n", &prior, &data, &page_bytes)) return NULL;
    PyObject *result = NULL;
    unsigned char *scratch = NULL;
    if (xxh3_128 == NULL || prior.len != 16 || page_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "chain_xxh3_128: unbound, or bad prior/page size");
        goto done;
    }
    Py_ssize_t pages = data.len / page_bytes;
    scratch = PyMem_Malloc(16 + pages * 16 + page_bytes);
    if (scratch == NULL) { PyErr_NoMemory(); goto done; }
    /* scratch = [prior | page being hashed], then the n digests, laid end to end */
    unsigned char *out = scratch + 16 + page_bytes;
    const unsigned char *src = data.buf;
    Py_BEGIN_ALLOW_THREADS
    memcpy(scratch, prior.buf, 16);
    for (Py_ssize_t i = 0; i < pages; i++) {
        memcpy(scratch + 16, src + i * page_bytes, page_bytes);
        hash128_t h = xxh3_128(scratch, 16 + page_bytes);
        put_be64(out + 16 * i, h.high64);
        put_be64(out + 16 * i + 8, h.low64);
        memcpy(scratch, out + 16 * i, 16);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(pages);
    for (Py_ssize_t i = 0; result != NULL && i < pages; i++) {
        PyObject *name = PyBytes_FromStringAndSize((const char *)out + 16 * i, 16);
        if (name == NULL) { Py_CLEAR(result); break; }
        PyList_SET_ITEM(result, i, name);
    }
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&prior);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Bind the address of XXH3_128bits(data, len)."},
    {"chain_xxh3_128", chain_xxh3_128, METH_VARARGS,
     "The 16-byte names of every full page of data, continuing from prior."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
