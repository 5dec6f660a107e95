/*
 * uint64 request and engine keys between Python ints and their bytes, for both C modules (kv_preflight/_speedups.c
 * and kv_preflight/index/_write_path.c): read from an int's digits, written as decimal.
 */
#ifndef KVPF_U64_H
#define KVPF_U64_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static const char DIGITS2[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* An int in [0, 2**64) as a uint64, with PyLong_AsUnsignedLongLong's errors (TypeError, OverflowError). That
 * function goes through _PyLong_AsByteArray, ~190 instructions a key (an ingester's cluster round converts a
 * few keys per engine block, a snapshot two per block); this reads an exact int's digits where ints keep them
 * in ob_digit (before 3.12: ~35 instructions with the call), else the signed conversion, then the mask for
 * [2**63, 2**64) (~200 for a key past 2**63, which half of them are: they are FNV hashes). */
static inline int as_u64(PyObject *o, unsigned long long *out) {
#if PY_VERSION_HEX < 0x030C0000
    /* PyLong_SHIFT bits a digit, least significant first, the sign in the size */
    if (PyLong_CheckExact(o) && Py_SIZE(o) >= 0 && Py_SIZE(o) <= (64 + PyLong_SHIFT - 1) / PyLong_SHIFT) {
        const digit *d = ((PyLongObject *)o)->ob_digit;
        unsigned long long v = 0;
        Py_ssize_t j = Py_SIZE(o);
        while (j > 0 && !(v >> (64 - PyLong_SHIFT))) v = v << PyLong_SHIFT | d[--j];
        if (j == 0) { *out = v; return 0; }
        /* past 64 bits: the error below */
    }
#endif
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "an integer is required, not %.200s", Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v >= 0) { *out = (unsigned long long)v; return 0; }
    }
    if (overflow > 0 && _PyLong_NumBits(o) <= 64) {
        *out = PyLong_AsUnsignedLongLongMask(o);
        return 0;
    }
    PyErr_SetString(PyExc_OverflowError, overflow > 0 ? "int too big to convert" : "can't convert negative int to unsigned");
    return -1;
}

/* v in decimal, written backwards ending just before ``end``, two digits a step; returns where the digits
 * start (snprintf cost ~600 instructions a number, most of pack_command's time). */
static inline char *write_u64(char *end, unsigned long long v) {
    char *p = end;
    while (v >= 100) {
        unsigned q = (unsigned)(v % 100);
        v /= 100;
        *--p = DIGITS2[2 * q + 1];
        *--p = DIGITS2[2 * q];
    }
    if (v >= 10) { *--p = DIGITS2[2 * v + 1]; *--p = DIGITS2[2 * v]; }
    else *--p = (char)('0' + v);
    return p;
}

#endif
