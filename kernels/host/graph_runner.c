/* The per-call tail of a planned call in C (kernels/native.py builds it on first use; where it
 * cannot, kernels/launch.py's Python path runs the same steps).
 *
 * A Runner belongs to one instantiated CUDA graph of a call's kernels (kernels/launch.py). A
 * call passes the stream, the call's tensors and a few integer pointers (the split workspace).
 * The runner reads the tensors' data pointers, refuses one the kernels cannot take (its
 * alignment: a misaligned 16-byte copy would fault the context, not raise), writes those that
 * changed since its last call
 * into the packed argument structs of the nodes that take them, re-sets exactly those nodes
 * (cuGraphExecKernelNodeSetParams copies the arguments at that moment) and launches the graph
 * (cuGraphLaunch). One Python call instead of a dozen Python steps and two ctypes calls.
 *
 * The driver functions come in as addresses (libcuda's, or a test's stand-ins), so this file
 * needs only Python's headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>

#define MAX_SOURCES 16
#define MAX_NODES 4
#define MAX_WRITES 16

typedef int (*launch_fn)(void *exe, void *stream);
typedef int (*set_fn)(void *exe, void *node, void *params);

typedef struct {
    int offset; /* byte offset of a pointer field in the node's packed arguments */
    int source; /* which of the call's pointers goes there */
} Write;

typedef struct {
    void *node, *params; /* the graph node; its CUDA_KERNEL_NODE_PARAMS */
    char *args;          /* the packed arguments its kernelParams point into */
    int n_writes;
    Write writes[MAX_WRITES];
} Node;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    launch_fn launch;
    set_fn set;
    void *exe;
    int n_tensors, n_sources, n_nodes, primed;
    Node nodes[MAX_NODES];
    uintptr_t last[MAX_SOURCES]; /* the pointers the nodes hold */
    uintptr_t misaligned[MAX_SOURCES]; /* a tensor's pointer bits that must be 0 (align - 1) */
    char names[MAX_SOURCES][16];       /* each tensor's name, for that error */
} Runner;

static PyObject *data_ptr_name;

static void *as_pointer(PyObject *value, const char *what) {
    void *p = PyLong_AsVoidPtr(value);
    if (p == NULL && PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "Runner: %s must be an int address", what);
    return p;
}

static PyObject *runner_call(PyObject *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    Runner *r = (Runner *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || n != 1 + r->n_sources) {
        PyErr_Format(PyExc_TypeError, "Runner takes %d positional arguments (stream, %d tensors, "
                     "%d ints)", 1 + r->n_sources, r->n_tensors, r->n_sources - r->n_tensors);
        return NULL;
    }
    void *stream = PyLong_AsVoidPtr(args[0]);
    if (stream == NULL && PyErr_Occurred())
        return NULL;
    uintptr_t now[MAX_SOURCES];
    for (int i = 0; i < r->n_sources; ++i) {
        PyObject *value = args[1 + i];
        if (i < r->n_tensors) {
            value = PyObject_CallMethodNoArgs(value, data_ptr_name);
            if (value == NULL)
                return NULL;
        }
        now[i] = (uintptr_t)PyLong_AsVoidPtr(value);
        if (i < r->n_tensors)
            Py_DECREF(value);
        if (PyErr_Occurred())
            return NULL;
        if (now[i] & r->misaligned[i])
            return PyErr_Format(PyExc_ValueError, "%s: data_ptr %p is not %d-byte aligned",
                                r->names[i], (void *)now[i], (int)(r->misaligned[i] + 1));
    }
    for (int j = 0; j < r->n_nodes; ++j) {
        Node *node = &r->nodes[j];
        int changed = !r->primed;
        for (int w = 0; w < node->n_writes && !changed; ++w)
            changed = now[node->writes[w].source] != r->last[node->writes[w].source];
        if (!changed)
            continue;
        for (int w = 0; w < node->n_writes; ++w)
            memcpy(node->args + node->writes[w].offset, &now[node->writes[w].source],
                   sizeof(uintptr_t));
        int err = r->set(r->exe, node->node, node->params);
        if (err) {
            r->primed = 0; /* what the nodes hold is no longer known */
            return PyErr_Format(PyExc_RuntimeError,
                                "cuGraphExecKernelNodeSetParams failed: CUresult %d", err);
        }
    }
    memcpy(r->last, now, sizeof(uintptr_t) * r->n_sources);
    r->primed = 1;
    int err = r->launch(r->exe, stream);
    if (err)
        return PyErr_Format(PyExc_RuntimeError, "cuGraphLaunch failed: CUresult %d", err);
    Py_RETURN_NONE;
}

static int set_aligns(Runner *r, PyObject *aligns) {
    PyObject *seq = PySequence_Fast(aligns, "Runner: aligns");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int ok = n <= r->n_tensors;
    for (Py_ssize_t i = 0; ok && i < n; ++i) {
        const char *name;
        int align;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "si", &name, &align) &&
             align >= 0 && align <= 4096 && (align & (align - 1)) == 0;
        if (ok) {
            r->misaligned[i] = align ? (uintptr_t)(align - 1) : 0;
            snprintf(r->names[i], sizeof r->names[i], "%s", name);
        }
    }
    Py_DECREF(seq);
    if (!ok && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError,
                        "Runner: aligns of at most n_tensors tensors, each 0 or a power of two <= 4096");
    return ok ? 0 : -1;
}

/* Runner(launch, set, exe, n_tensors, n_sources, nodes[, aligns]): addresses as ints; nodes a
 * sequence of (node, params, args, ((offset, source), ...)); aligns, of the first tensors,
 * ((name, bytes), ...) with bytes 0 (any) or a power of two up to 4096. */
static PyObject *runner_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)kwargs;
    PyObject *launch, *set, *exe, *nodes, *aligns = NULL;
    int n_tensors, n_sources;
    if (!PyArg_ParseTuple(args, "OOOiiO|O", &launch, &set, &exe, &n_tensors, &n_sources, &nodes,
                          &aligns))
        return NULL;
    if (n_tensors < 0 || n_sources < n_tensors || n_sources > MAX_SOURCES) {
        PyErr_SetString(PyExc_ValueError, "Runner: 0 <= n_tensors <= n_sources <= 16");
        return NULL;
    }
    Runner *r = (Runner *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    r->vectorcall = runner_call;
    r->n_tensors = n_tensors;
    r->n_sources = n_sources;
    r->launch = (launch_fn)as_pointer(launch, "launch");
    r->set = (set_fn)as_pointer(set, "set");
    r->exe = as_pointer(exe, "exe");
    PyObject *seq = PyErr_Occurred() ? NULL : PySequence_Fast(nodes, "Runner: nodes");
    if (seq == NULL)
        goto fail;
    r->n_nodes = (int)PySequence_Fast_GET_SIZE(seq);
    if (r->n_nodes < 1 || r->n_nodes > MAX_NODES) {
        PyErr_SetString(PyExc_ValueError, "Runner: 1 to 4 nodes");
        goto fail_seq;
    }
    for (int j = 0; j < r->n_nodes; ++j) {
        Node *node = &r->nodes[j];
        PyObject *handle, *params, *packed, *writes;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, j), "OOOO", &handle, &params,
                              &packed, &writes))
            goto fail_seq;
        node->node = as_pointer(handle, "node");
        node->params = as_pointer(params, "params");
        node->args = (char *)as_pointer(packed, "args");
        if (PyErr_Occurred())
            goto fail_seq;
        PyObject *ws = PySequence_Fast(writes, "Runner: a node's writes");
        if (ws == NULL)
            goto fail_seq;
        node->n_writes = (int)PySequence_Fast_GET_SIZE(ws);
        int ok = node->n_writes <= MAX_WRITES;
        for (int w = 0; ok && w < node->n_writes; ++w) {
            Write *write = &node->writes[w];
            ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ws, w), "ii", &write->offset,
                                  &write->source) &&
                 write->offset >= 0 && write->source >= 0 && write->source < n_sources;
        }
        Py_DECREF(ws);
        if (!ok) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError,
                                "Runner: at most 16 writes a node, sources below n_sources");
            goto fail_seq;
        }
    }
    Py_DECREF(seq);
    if (aligns != NULL && set_aligns(r, aligns) < 0)
        goto fail;
    return (PyObject *)r;
fail_seq:
    Py_DECREF(seq);
fail:
    Py_DECREF(r);
    return NULL;
}

static PyTypeObject RunnerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_graph_runner.Runner",
    .tp_basicsize = sizeof(Runner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Runner, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = runner_new,
    .tp_doc = "One graph's per-call tail: pointers in, changed nodes re-set, one launch.",
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_graph_runner", .m_size = -1};

PyMODINIT_FUNC PyInit__graph_runner(void) {
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    if (data_ptr_name == NULL || PyType_Ready(&RunnerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RunnerType);
    if (PyModule_AddObject(m, "Runner", (PyObject *)&RunnerType) < 0) {
        Py_DECREF(&RunnerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
