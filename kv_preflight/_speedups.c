/*
 * One call hashes a whole chain of llm-d request keys.
 *
 * Each key is FNV-64a over the canonical CBOR of [parent, tokens, nil]. Doing the
 * CBOR encoding and the hashing in C, streaming bytes straight into FNV without
 * building the encoding, turns ~6 us of Python per block into ~1 ns per token.
 * kv_preflight/keys/chain.py keeps the pure-Python reference; tests check both agree.
 *
 * Tokens come as a list or tuple of ints (read without a call per item when the
 * int is small, as every token id is), as any object with the buffer protocol and
 * an integer format (array('I'), numpy uint32, memoryview), or as any sequence.
 * FNV is a serial chain (each byte depends on the previous state), so the floor is
 * one multiply latency per CBOR byte; what is left around it is kept off the loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX, READONLY (in Python.h from 3.12) */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define FNV_OFFSET 14695981039346656037ULL
#define FNV_PRIME 1099511628211ULL

static inline uint64_t fnv_byte(uint64_t h, uint8_t b) {
    h ^= b;
    return h * FNV_PRIME;
}

/* CBOR head: major type (0..7) and argument, shortest form (canonical). */
static inline uint64_t fnv_head(uint64_t h, uint8_t major, uint64_t v) {
    uint8_t mt = (uint8_t)(major << 5);
    if (v < 24) return fnv_byte(h, mt | (uint8_t)v);
    if (v <= 0xff) { h = fnv_byte(h, mt | 24); return fnv_byte(h, (uint8_t)v); }
    if (v <= 0xffff) {
        h = fnv_byte(h, mt | 25);
        h = fnv_byte(h, (uint8_t)(v >> 8));
        return fnv_byte(h, (uint8_t)v);
    }
    if (v <= 0xffffffffULL) {
        h = fnv_byte(h, mt | 26);
        h = fnv_byte(h, (uint8_t)(v >> 24));
        h = fnv_byte(h, (uint8_t)(v >> 16));
        h = fnv_byte(h, (uint8_t)(v >> 8));
        return fnv_byte(h, (uint8_t)v);
    }
    h = fnv_byte(h, mt | 27);
    for (int s = 56; s >= 0; s -= 8) h = fnv_byte(h, (uint8_t)(v >> s));
    return h;
}

/* A token id from a Python int: inline for exact small ints, else the C API. -1 on error. */
static inline int token_of(PyObject *o, uint64_t *out) {
    if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
            if (v >= 0) { *out = (uint64_t)v; return 0; }
        }
#else
        Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        if (size == 1) { *out = d[0]; return 0; }
        if (size == 0) { *out = 0; return 0; }
        if (size == 2) { *out = (uint64_t)d[0] | ((uint64_t)d[1] << PyLong_SHIFT); goto check; }
#endif
    }
    {
        unsigned long long t = PyLong_AsUnsignedLongLong(o);
        if (t == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        *out = t;
    }
#if PY_VERSION_HEX < 0x030C0000
check:
#endif
    if (*out > 0xffffffffULL) {
        PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
        return -1;
    }
    return 0;
}

static inline uint64_t block_start(uint64_t prev, Py_ssize_t block_size) {
    uint64_t h = FNV_OFFSET;
    h = fnv_byte(h, 0x83);                    /* array(3) */
    h = fnv_head(h, 0, prev);                 /* parent */
    return fnv_head(h, 4, (uint64_t)block_size); /* array(block_size) */
}

/* Keys from a buffer of integers (array('I'), numpy, memoryview). Returns 0, or -1 with an error set. */
static int keys_from_buffer(Py_buffer *view, uint64_t prev, Py_ssize_t block_size, Py_ssize_t nblocks, uint64_t *out) {
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    char f = *fmt;
    Py_ssize_t isz = view->itemsize;
    const char *base = (const char *)view->buf;
    int is_signed = (f == 'b' || f == 'h' || f == 'i' || f == 'l' || f == 'q' || f == 'n');
    int is_int = is_signed || f == 'B' || f == 'H' || f == 'I' || f == 'L' || f == 'Q' || f == 'N';
    if (!is_int || fmt[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "token buffer must hold integers, not format '%s'", view->format);
        return -1;
    }
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        uint64_t h = block_start(prev, block_size);
        for (Py_ssize_t i = b * block_size; i < (b + 1) * block_size; i++) {
            const char *p = base + i * isz;
            int64_t sv = 0;
            uint64_t t;
            switch (isz) {
            case 1: if (is_signed) sv = *(const int8_t *)p; else sv = *(const uint8_t *)p; break;
            case 2: { int16_t s; uint16_t u; if (is_signed) { memcpy(&s, p, 2); sv = s; } else { memcpy(&u, p, 2); sv = u; } break; }
            case 4: { int32_t s; uint32_t u; if (is_signed) { memcpy(&s, p, 4); sv = s; } else { memcpy(&u, p, 4); sv = u; } break; }
            case 8: { uint64_t u; memcpy(&u, p, 8);
                      if (is_signed && (int64_t)u < 0) sv = -1; else if (u > 0xffffffffULL) sv = (int64_t)0x100000000LL; else sv = (int64_t)u;
                      break; }
            default:
                PyErr_SetString(PyExc_TypeError, "unsupported token item size");
                return -1;
            }
            if (sv < 0 || sv > 0xffffffffLL) {
                PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
                return -1;
            }
            t = (uint64_t)sv;
            h = fnv_head(h, 0, t);
        }
        h = fnv_byte(h, 0xf6);                /* extra = nil */
        out[b] = h;
        prev = h;
    }
    return 0;
}

static PyObject *list_of(const uint64_t *keys, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *k = PyLong_FromUnsignedLongLong(keys[b]);
        if (k == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, b, k);
    }
    return out;
}

/* request_keys(parent: int, tokens, block_size: int) -> list[int] */
static PyObject *request_keys(PyObject *self, PyObject *args) {
    unsigned long long parent;
    PyObject *tokens_obj;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "KOn", &parent, &tokens_obj, &block_size)) return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    uint64_t prev = (uint64_t)parent;
    if (!PyList_Check(tokens_obj) && !PyTuple_Check(tokens_obj) && PyObject_CheckBuffer(tokens_obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(tokens_obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
        Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
        Py_ssize_t nblocks = n / block_size;
        uint64_t *keys = PyMem_Malloc(sizeof(uint64_t) * (nblocks ? nblocks : 1));
        if (keys == NULL) { PyBuffer_Release(&view); return PyErr_NoMemory(); }
        int rc = keys_from_buffer(&view, prev, block_size, nblocks, keys);
        PyBuffer_Release(&view);
        PyObject *out = rc == 0 ? list_of(keys, nblocks) : NULL;
        PyMem_Free(keys);
        return out;
    }
    PyObject *seq = PySequence_Fast(tokens_obj, "tokens must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t nblocks = n / block_size;
    PyObject *out = PyList_New(nblocks);
    if (out == NULL) { Py_DECREF(seq); return NULL; }
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        uint64_t h = block_start(prev, block_size);
        PyObject **it = items + b * block_size;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            uint64_t t;
            if (token_of(it[i], &t) < 0) goto fail;
            h = fnv_head(h, 0, t);
        }
        h = fnv_byte(h, 0xf6);              /* extra = nil */
        PyObject *k = PyLong_FromUnsignedLongLong(h);
        if (k == NULL) goto fail;
        PyList_SET_ITEM(out, b, k);
        prev = h;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* request_keys_json(parent: int, raw: bytes-like, block_size: int) -> (list[int], n_tokens)
 *
 * ``raw`` is the JSON text of a token-id array, e.g. the ``token_ids`` member of a request
 * body captured as msgspec.Raw. Numbers are parsed and hashed in one pass, with no Python
 * int per token. Only plain non-negative integers up to 2^32-1 are accepted (no sign,
 * fraction, exponent or leading zero); anything else raises ValueError, and the caller
 * falls back to its full decoder, which also words the error. */
/* JSON whitespace skipped: the first byte at or after p that is not whitespace (end if none). */
static inline const unsigned char *skip_ws(const unsigned char *p, const unsigned char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

static PyObject *request_keys_json(PyObject *self, PyObject *args) {
    unsigned long long parent;
    Py_buffer raw;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "Ky*n", &parent, &raw, &block_size)) return NULL;
    PyObject *result = NULL;
    uint64_t *keys = NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        goto done;
    }
    const unsigned char *p = (const unsigned char *)raw.buf, *end = p + raw.len;
    Py_ssize_t cap = raw.len / (2 * block_size) + 1, nkeys = 0, ntok = 0, in_block = 0;
    keys = PyMem_Malloc(sizeof(uint64_t) * cap);
    if (keys == NULL) { PyErr_NoMemory(); goto done; }
    uint64_t prev = (uint64_t)parent, h = 0;
    p = skip_ws(p, end);
    if (p >= end || *p != '[') goto bad;
    p++;
    p = skip_ws(p, end);
    if (p < end && *p == ']') { p++; goto close; }
    for (;;) {
        if (p >= end || *p < '0' || *p > '9') goto bad;
        uint64_t v = (uint64_t)(*p++ - '0');
        if (v == 0 && p < end && *p >= '0' && *p <= '9') goto bad; /* leading zero */
        int digits = 1;
        while (p < end && *p >= '0' && *p <= '9') {
            v = v * 10 + (uint64_t)(*p++ - '0');
            if (++digits > 10) goto bad;
        }
        if (v > 0xffffffffULL) goto bad;
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) goto bad;
        if (in_block == 0) h = block_start(prev, block_size);
        h = fnv_head(h, 0, v);
        ntok++;
        if (++in_block == block_size) {
            h = fnv_byte(h, 0xf6);          /* extra = nil */
            if (nkeys == cap) {
                cap *= 2;
                uint64_t *grown = PyMem_Realloc(keys, sizeof(uint64_t) * cap);
                if (grown == NULL) { PyErr_NoMemory(); goto done; }
                keys = grown;
            }
            keys[nkeys++] = h;
            prev = h;
            in_block = 0;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') { p++; p = skip_ws(p, end); continue; }
        if (p < end && *p == ']') { p++; break; }
        goto bad;
    }
close:
    p = skip_ws(p, end);
    if (p != end) goto bad;
    {
        PyObject *list = list_of(keys, nkeys);
        if (list == NULL) goto done;
        result = Py_BuildValue("(Nn)", list, ntok);
    }
    goto done;
bad:
    PyErr_SetString(PyExc_ValueError, "not a JSON array of integers in [0, 4294967295]");
done:
    PyMem_Free(keys);
    PyBuffer_Release(&raw);
    return result;
}

/* The end of the JSON string starting at p (its opening quote), or NULL: escapes skipped, not checked. */
static const unsigned char *skip_json_string(const unsigned char *p, const unsigned char *end) {
    for (p++; p < end; p++) {
        if (*p == '\\') { p++; continue; }
        if (*p == '"') return p + 1;
    }
    return NULL;
}

/* The end of the JSON value starting at p, or NULL. Only its extent is found (brackets balanced, strings
 * skipped whole, numbers and literals by their characters): whoever reads the value checks it. */
static const unsigned char *skip_json_value(const unsigned char *p, const unsigned char *end) {
    if (p >= end) return NULL;
    if (*p == '"') return skip_json_string(p, end);
    if (*p == '{' || *p == '[') {
        int depth = 0;
        while (p < end) {
            unsigned char c = *p;
            if (c == '"') {
                p = skip_json_string(p, end);
                if (p == NULL) return NULL;
                continue;
            }
            if (c == '{' || c == '[') {
                if (++depth > 1000) return NULL;
            } else if (c == '}' || c == ']') {
                if (--depth == 0) return p + 1;
            }
            p++;
        }
        return NULL;
    }
    const unsigned char *start = p;
    while (p < end && ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                       *p == '-' || *p == '+' || *p == '.')) p++;
    return p > start ? p : NULL;
}

/* member_span(doc: bytes-like, name: bytes) -> (start, end) | None
 *
 * Where the value of the top-level member ``name`` of a JSON object lies in ``doc``: one pass over the object
 * that skips every value, so a caller can read that member its own way and have its full decoder read the rest
 * (the gateway keys a token-id prompt from its text, and decodes the body with ``[]`` in its place: the
 * decoder's scan of 20 KB of digits was a sixth of a forwarded request's instructions). None when the text is
 * not an object this pass can follow whole, a member name holds an escape, or ``name`` is not there exactly once:
 * the caller decodes it all the ordinary way, which also words any error. */
static PyObject *member_span(PyObject *self, PyObject *args) {
    Py_buffer doc;
    const char *name;
    Py_ssize_t nlen;
    if (!PyArg_ParseTuple(args, "y*y#", &doc, &name, &nlen)) return NULL;
    const unsigned char *base = (const unsigned char *)doc.buf, *p = base, *end = base + doc.len;
    Py_ssize_t found_at = -1, found_end = -1;
    int ok = 0;
    p = skip_ws(p, end);
    if (p >= end || *p != '{') goto done;
    p++;
    p = skip_ws(p, end);
    if (p < end && *p == '}') { p++; goto close; }
    for (;;) {
        if (p >= end || *p != '"') goto done;
        const unsigned char *key = ++p;
        while (p < end && *p != '"' && *p != '\\') p++;
        if (p >= end || *p != '"') goto done;  /* an escape in a member's name: the ordinary way */
        Py_ssize_t klen = p - key;
        p++;
        p = skip_ws(p, end);
        if (p >= end || *p != ':') goto done;
        p++;
        p = skip_ws(p, end);
        const unsigned char *value = p;
        p = skip_json_value(p, end);
        if (p == NULL) goto done;
        if (klen == nlen && memcmp(key, name, (size_t)nlen) == 0) {
            if (found_at >= 0) goto done;      /* twice: the ordinary way says which counts */
            found_at = value - base;
            found_end = p - base;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') { p++; p = skip_ws(p, end); continue; }
        if (p < end && *p == '}') { p++; break; }
        goto done;
    }
close:
    p = skip_ws(p, end);
    ok = p == end && found_at >= 0;
done:
    PyBuffer_Release(&doc);
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", found_at, found_end);
}

#define KEY_WIDTH 20 /* decimal digits of the largest uint64 */

#include "_u64.h"

/* One uint64 into its fixed-width slot of ``width`` bytes. */
typedef void (*put_u64)(char *slot, unsigned long long v);

static void put_le(char *slot, unsigned long long v) {
    for (int b = 0; b < 8; b++) slot[b] = (char)(unsigned char)(v >> (8 * b));
}

static void put_decimal(char *slot, unsigned long long v) {
    char *p = write_u64(slot + KEY_WIDTH, v);
    memset(slot, ' ', (size_t)(p - slot));
}

/* Ints (each in [0, 2**64)) packed into fixed-width slots, concatenated. */
static PyObject *pack_each(PyObject *arg, Py_ssize_t width, put_u64 put) {
    PyObject *seq = PySequence_Fast(arg, "keys must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * width);
    if (out == NULL) { Py_DECREF(seq); return NULL; }
    char *buf = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v;
        if (as_u64(items[i], &v) < 0) { Py_DECREF(seq); Py_DECREF(out); return NULL; }
        put(buf + i * width, v);
    }
    Py_DECREF(seq);
    return out;
}

/* pack_u64s(values: sequence[int]) -> bytes: each value as 8 little-endian bytes (struct.pack("<nQ", *values)
 * converts each through _PyLong_AsByteArray: a pod's snapshot packs its whole state's keys every few batches). */
static PyObject *pack_u64s(PyObject *self, PyObject *arg) {
    return pack_each(arg, 8, put_le);
}

/* pack_keys(keys: sequence[int]) -> bytes: each key as 20 characters, decimal, right-aligned, space-padded.
 * The lookup script reads key i at a fixed offset, so a chain travels as one argument. */
static PyObject *pack_keys(PyObject *self, PyObject *arg) {
    return pack_each(arg, KEY_WIDTH, put_decimal);
}

/* The attribute names snapshot_columns() reads off pod_state._Block, interned once at import. */
#ifdef Py_T_OBJECT_EX /* 3.12 on */
#define SLOT_OBJECT_EX Py_T_OBJECT_EX
#define SLOT_READONLY Py_READONLY
#else
#define SLOT_OBJECT_EX T_OBJECT_EX
#define SLOT_READONLY READONLY
#endif

/* Where instances of ``type`` hold the field ``name``: a msgspec Struct's field is a slot (a member descriptor
 * of kind T_OBJECT_EX, defined by ``type`` itself). -1, no error set, for anything else. */
static Py_ssize_t slot_offset(PyObject *type, const char *name) {
    PyObject *d = PyObject_GetAttrString(type, name);
    if (d == NULL) { PyErr_Clear(); return -1; }
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type) && PyDescr_TYPE(d) == (PyTypeObject *)type) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == SLOT_OBJECT_EX && !(m->flags & ~SLOT_READONLY) && m->offset > 0
            && m->offset + (Py_ssize_t)sizeof(PyObject *) <= ((PyTypeObject *)type)->tp_basicsize)
            off = m->offset;
    }
    Py_DECREF(d);
    return off;
}

/* The object in the slot at ``off`` of ``o`` (borrowed; NULL when unset). */
#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static PyObject *s_field, *s_rks, *s_parent, *s_copies;
enum { A_FIELD, A_RKS, A_PARENT, A_COPIES };
#define NOT_HELD "more than 16 tiers or a group past 255: not a state this format holds" /* pod_state's words */

/* Reads the blocks' attributes from their slots (a msgspec Struct's fields: ``slot_offset``) in the first
 * block's class, as PyObject_GenericGetAttr does but without its type lookup per read (by name, the reads were
 * half of snapshot_columns' instructions); a block of another class, or of one whose attributes are not plain
 * slots of its own or that has its own getattr, is read by name. */
typedef struct {
    PyTypeObject *type;  /* NULL: by name */
    Py_ssize_t off[4];  /* A_FIELD..A_COPIES */
} block_reader;

static void reader_init(block_reader *r, PyObject *block) {
    static const char *const names[4] = {"field", "rks", "parent", "copies"};
    PyTypeObject *type = Py_TYPE(block);
    r->type = NULL;
    if (type->tp_getattro != PyObject_GenericGetAttr) return;
    for (int a = 0; a < 4; a++) {
        if ((r->off[a] = slot_offset((PyObject *)type, names[a])) < 0) return;
    }
    r->type = type;
}

static PyObject *read_attr(const block_reader *r, PyObject *block, int a) {
    static PyObject **const names[4] = {&s_field, &s_rks, &s_parent, &s_copies};
    if (Py_TYPE(block) == r->type) {
        PyObject *v = SLOT(block, r->off[a]);
        if (v == NULL) PyErr_SetObject(PyExc_AttributeError, *names[a]);
        return Py_XNewRef(v);
    }
    return PyObject_GetAttr(block, *names[a]);
}

/* Whether an exact int is the uint64 ``v``, never an error: a parent outside uint64 (CHAIN_ROOT, -1) is no
 * request key. */
static int int_is_u64(PyObject *o, unsigned long long v) {
    unsigned long long u;
    if (as_u64(o, &u) == 0) return u == v;
    PyErr_Clear();
    return 0;
}

/* A per-block column as a list, one value when every block has it (pod_log._column). */
static PyObject *column_of(const long long *values, Py_ssize_t n) {
    Py_ssize_t len = n > 0 ? 1 : 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (values[i] != values[0]) { len = n; break; }
    }
    PyObject *out = PyList_New(len);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *v = PyLong_FromLongLong(values[i]);
        if (v == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* The id of ``name`` in ``ids`` (name -> int, in order of first appearance, also listed in ``names`` unless
 * NULL), a new one if it has none; -1 with an error. */
static long long id_of(PyObject *ids, PyObject *names, PyObject *name) {
    PyObject *id = PyDict_GetItemWithError(ids, name);  /* borrowed */
    if (id != NULL) return PyLong_AsLongLong(id);
    if (PyErr_Occurred()) return -1;
    Py_ssize_t next = PyDict_GET_SIZE(ids);
    if ((id = PyLong_FromSsize_t(next)) == NULL) return -1;
    int rc = PyDict_SetItem(ids, name, id);
    Py_DECREF(id);
    if (rc < 0 || (names != NULL && PyList_Append(names, name) < 0)) return -1;
    return next;
}

/* snapshot_columns(blocks: dict[(ek, tier, group), _Block]) -> (fields, tiers, engine_keys, request_keys,
 * counts, codes, chained, parents, copies): the per-block columns of pod_log._Snapshot, byte for byte as
 * its Python path (pod_log._columns, the reference) builds them, in one pass over the blocks. An ingester
 * snapshots each pod every few batches, over its whole state (thousands of blocks): the Python path's
 * comprehensions took a sixth of its CPU (a pod of 2,048 one-key blocks: ~9.0M instructions a snapshot, ~1.1M
 * with this). What the format cannot hold (a key outside uint64, a group outside
 * a byte, a 17th tier) raises OverflowError or ValueError, and anything not plainly typed (fields and tiers
 * exact str, rks a tuple, a parent None or an exact int, copies an exact int) TypeError: the caller then
 * takes the Python path, which words the error (or takes the odd type as Python does). No Python code runs
 * in the loop for what is accepted. */
static PyObject *snapshot_columns(PyObject *self, PyObject *blocks) {
    if (!PyDict_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a dict");
        return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(blocks), cap = 8 * n + 8, rlen = 0;
    PyObject *result = NULL, *fids = PyDict_New(), *tids = PyDict_New(), *fields = PyList_New(0);
    PyObject *tiers = PyList_New(0), *parents = PyList_New(0), *copies = PyDict_New();
    PyObject *eks = PyBytes_FromStringAndSize(NULL, 8 * n), *chained = PyBytes_FromStringAndSize(NULL, (n + 7) / 8);
    PyObject *counts_col = NULL, *codes_col = NULL, *rks_col = NULL;
    long long *codes = PyMem_Malloc(sizeof(long long) * (size_t)(n + 1));
    long long *counts = PyMem_Malloc(sizeof(long long) * (size_t)(n + 1));
    char *rks = PyMem_Malloc((size_t)cap);
    /* owned while read; the last field and tier seen, with their ids (a pod's blocks mostly share them) */
    PyObject *key = NULL, *block = NULL, *field = NULL, *rk_tuple = NULL, *parent = NULL, *copy_count = NULL;
    PyObject *seen_field = NULL, *seen_tier = NULL;
    block_reader reader = {NULL, {0, 0, 0, 0}};
    long long fid = 0, tid = 0;
    if (!fids || !tids || !fields || !tiers || !parents || !copies || !eks || !chained) goto fail;
    if (!codes || !counts || !rks) { PyErr_NoMemory(); goto fail; }
    char *ek_buf = PyBytes_AS_STRING(eks);
    unsigned char *bits = (unsigned char *)PyBytes_AS_STRING(chained);
    memset(bits, 0, (size_t)((n + 7) / 8));
    unsigned long long last = 0;  /* the previous block's last request key, when it has one */
    int have_last = 0;
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *b;
    while (PyDict_Next(blocks, &pos, &k, &b)) {
        if (i == n) goto resized;
        key = Py_NewRef(k);
        block = Py_NewRef(b);
        if (i == 0) reader_init(&reader, block);
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 3) {
            PyErr_SetString(PyExc_TypeError, "a block's key must be (engine key, tier, group)");
            goto fail;
        }
        PyObject *tier = PyTuple_GET_ITEM(key, 1), *group = PyTuple_GET_ITEM(key, 2);
        unsigned long long ek, g;
        if (as_u64(PyTuple_GET_ITEM(key, 0), &ek) < 0 || as_u64(group, &g) < 0) goto fail;
        put_le(ek_buf + 8 * i, ek);
        if (g > 255) {
            PyErr_SetString(PyExc_ValueError, NOT_HELD);
            goto fail;
        }
        if ((field = read_attr(&reader, block, A_FIELD)) == NULL) goto fail;
        if (!PyUnicode_CheckExact(field) || !PyUnicode_CheckExact(tier)) {
            PyErr_SetString(PyExc_TypeError, "a block's field and tier must be str");
            goto fail;
        }
        if (field != seen_field) {
            if ((fid = id_of(fids, fields, field)) < 0) goto fail;
            Py_XSETREF(seen_field, Py_NewRef(field));
        }
        if (tier != seen_tier) {
            if ((tid = id_of(tids, tiers, tier)) < 0) goto fail;
            if (tid > 15) {
                PyErr_SetString(PyExc_ValueError, NOT_HELD);
                goto fail;
            }
            Py_XSETREF(seen_tier, Py_NewRef(tier));
        }
        codes[i] = fid << 12 | (long long)g << 4 | tid;
        /* chained: the parent is the previous block's last request key (so neither None nor CHAIN_ROOT) */
        if ((parent = read_attr(&reader, block, A_PARENT)) == NULL) goto fail;
        if (parent != Py_None && !PyLong_CheckExact(parent)) {
            PyErr_SetString(PyExc_TypeError, "a block's parent must be an int or None");
            goto fail;
        }
        if (parent != Py_None && have_last && int_is_u64(parent, last)) bits[i >> 3] |= (unsigned char)(1 << (i & 7));
        else if (PyList_Append(parents, parent) < 0) goto fail;
        if ((rk_tuple = read_attr(&reader, block, A_RKS)) == NULL) goto fail;
        if (!PyTuple_Check(rk_tuple)) {
            PyErr_SetString(PyExc_TypeError, "a block's request keys must be a tuple");
            goto fail;
        }
        Py_ssize_t count = PyTuple_GET_SIZE(rk_tuple);
        counts[i] = count;
        if (rlen + 8 * count > cap) {
            while (rlen + 8 * count > cap) cap *= 2;
            char *grown = PyMem_Realloc(rks, (size_t)cap);
            if (grown == NULL) { PyErr_NoMemory(); goto fail; }
            rks = grown;
        }
        for (Py_ssize_t j = 0; j < count; j++, rlen += 8) {
            if (as_u64(PyTuple_GET_ITEM(rk_tuple, j), &last) < 0) goto fail;
            put_le(rks + rlen, last);
        }
        have_last = count > 0;
        if ((copy_count = read_attr(&reader, block, A_COPIES)) == NULL) goto fail;
        if (!PyLong_CheckExact(copy_count)) {
            PyErr_SetString(PyExc_TypeError, "a block's copies must be an int");
            goto fail;
        }
        int overflow = 0;
        long long c = PyLong_AsLongLongAndOverflow(copy_count, &overflow);
        if (overflow > 0 || (overflow == 0 && c > 1)) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL) goto fail;
            int rc = PyDict_SetItem(copies, index, copy_count);
            Py_DECREF(index);
            if (rc < 0) goto fail;
        }
        Py_CLEAR(key); Py_CLEAR(block); Py_CLEAR(field); Py_CLEAR(parent); Py_CLEAR(rk_tuple); Py_CLEAR(copy_count);
        i++;
    }
    if (i != n) goto resized;
    if ((counts_col = column_of(counts, n)) == NULL || (codes_col = column_of(codes, n)) == NULL) goto fail;
    if ((rks_col = PyBytes_FromStringAndSize(rks, rlen)) == NULL) goto fail;
    if ((result = PyTuple_New(9)) == NULL) goto fail;
    PyObject *columns[9] = {fields, tiers, eks, rks_col, counts_col, codes_col, chained, parents, copies};
    for (int c = 0; c < 9; c++) PyTuple_SET_ITEM(result, c, columns[c]);  /* steals each */
    fields = tiers = eks = rks_col = counts_col = codes_col = chained = parents = copies = NULL;
    goto done;
resized:
    PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
fail:
    Py_XDECREF(key); Py_XDECREF(block); Py_XDECREF(field); Py_XDECREF(parent); Py_XDECREF(rk_tuple);
    Py_XDECREF(copy_count);
done:
    Py_XDECREF(seen_field); Py_XDECREF(seen_tier);
    Py_XDECREF(fids); Py_XDECREF(tids); Py_XDECREF(fields); Py_XDECREF(tiers); Py_XDECREF(parents);
    Py_XDECREF(copies); Py_XDECREF(eks); Py_XDECREF(chained); Py_XDECREF(counts_col); Py_XDECREF(codes_col);
    Py_XDECREF(rks_col);
    PyMem_Free(codes); PyMem_Free(counts); PyMem_Free(rks);
    return result;
}

/* CRC16-CCITT (XMODEM), the hash Valkey Cluster takes a key's slot from (crc16(key) mod 16384). */
static uint16_t CRC16_TABLE[256];

static void crc16_init(void) {
    for (int i = 0; i < 256; i++) {
        uint16_t c = (uint16_t)(i << 8);
        for (int j = 0; j < 8; j++) c = (uint16_t)((c & 0x8000) ? (c << 1) ^ 0x1021 : c << 1);
        CRC16_TABLE[i] = c;
    }
}

/* slot_groups(keys: sequence[int], table: bytes, groups: int) -> list[list[int]]: the positions of a
 * chain's request keys (named by their decimal value, llm-d's name: no hash tag) grouped by the shard
 * that serves each key's slot. table[slot] is a shard's index (< groups - 1) or 255 (no shard serves
 * it: the last group). A 32K-token chain has 2,048 keys; in Python this was ~3 ms a lookup. */
static PyObject *slot_groups(PyObject *self, PyObject *args) {
    PyObject *keys_obj;
    Py_buffer table;
    Py_ssize_t groups;
    const char *prefix = "";
    Py_ssize_t prefix_len = 0;
    if (!PyArg_ParseTuple(args, "Oy*n|y#", &keys_obj, &table, &groups, &prefix, &prefix_len)) return NULL;
    if (table.len != 16384 || groups < 1 || groups > 256) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "table must be 16384 bytes and groups in 1..256");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys_obj, "keys must be a sequence of ints");
    if (seq == NULL) { PyBuffer_Release(&table); return NULL; }
    PyObject *out = PyList_New(groups);
    if (out == NULL) goto fail;
    for (Py_ssize_t g = 0; g < groups; g++) {
        PyObject *l = PyList_New(0);
        if (l == NULL) goto fail;
        PyList_SET_ITEM(out, g, l);
    }
    const uint8_t *map = (const uint8_t *)table.buf;
    uint16_t crc0 = 0;  /* CRC16 runs left to right: the prefix's state, then each key's digits */
    for (Py_ssize_t j = 0; j < prefix_len; j++)
        crc0 = (uint16_t)((crc0 << 8) ^ CRC16_TABLE[((crc0 >> 8) ^ (uint8_t)prefix[j]) & 0xff]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v;
        if (as_u64(items[i], &v) < 0) goto fail;
        char digits[24];
        char *p = write_u64(digits + sizeof digits, v);
        uint16_t crc = crc0;
        for (; p < digits + sizeof digits; p++) crc = (uint16_t)((crc << 8) ^ CRC16_TABLE[((crc >> 8) ^ (uint8_t)*p) & 0xff]);
        uint8_t shard = map[crc & 16383];
        Py_ssize_t g = shard < groups - 1 ? shard : groups - 1;
        PyObject *pos = PyLong_FromSsize_t(i);
        if (pos == NULL || PyList_Append(PyList_GET_ITEM(out, g), pos) < 0) { Py_XDECREF(pos); goto fail; }
        Py_DECREF(pos);
    }
    Py_DECREF(seq);
    PyBuffer_Release(&table);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    PyBuffer_Release(&table);
    return NULL;
}

/* What the walk below emits per pod: a match built by ``make(name, held, tiers[held - 1])`` for a number
 * ``names`` knows (others are left out). */
typedef struct {
    PyObject *out;
    PyObject *names;  /* dict int -> str */
    PyObject **tiers;
    Py_ssize_t n_tiers;
    PyObject *make;
} prefix_emit;

static int emit_prefix(prefix_emit *e, Py_ssize_t num, Py_ssize_t held) {
    PyObject *key = PyLong_FromSsize_t(num);
    if (key == NULL) return -1;
    PyObject *name = PyDict_GetItemWithError(e->names, key);  /* borrowed */
    Py_DECREF(key);
    if (name == NULL) return PyErr_Occurred() ? -1 : 0;
    if (held < 1 || held > e->n_tiers) {
        PyErr_SetString(PyExc_ValueError, "a tier for every key walked is needed");
        return -1;
    }
    PyObject *count = PyLong_FromSsize_t(held);
    if (count == NULL) return -1;
    PyObject *call_args[3] = {name, count, e->tiers[held - 1]};
    PyObject *item = PyObject_Vectorcall(e->make, call_args, 3, NULL);
    Py_DECREF(count);
    if (item == NULL) return -1;
    int rc = PyList_Append(e->out, item);
    Py_DECREF(item);
    return rc;
}

/* The walk: per pod number, how many leading keys of a chain it holds, from each key's pod bitmap (bit n
 * of a bitmap = byte n / 8, value 1 << n % 8; None or b"": nobody). Pods are those of bitmaps[0]; each is
 * emitted once, at the key where it stops (or at ``end``), in key order and, within a key, by number:
 * kv_preflight/index/presence.py's walk for chains whose keys have one tier each, the per-pod part of a prediction
 * at a prefix a whole fleet holds. */
static PyObject *walk_prefixes(PyObject *maps_obj, Py_ssize_t end, prefix_emit *e) {
    PyObject *seq = PySequence_Fast(maps_obj, "bitmaps must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (end > n) end = n;
    PyObject *out = e->out = PyList_New(0);
    uint8_t *alive = NULL;
    if (out == NULL || end <= 0) goto done;
    for (Py_ssize_t i = 0; i < end; i++) {
        if (items[i] != Py_None && !PyBytes_Check(items[i])) {
            PyErr_SetString(PyExc_TypeError, "each bitmap must be bytes or None");
            goto fail;
        }
    }
    if (items[0] == Py_None) goto done;
    Py_ssize_t width = PyBytes_GET_SIZE(items[0]);
    alive = PyMem_Malloc(width > 0 ? (size_t)width : 1);
    if (alive == NULL) { PyErr_NoMemory(); goto fail; }
    memcpy(alive, PyBytes_AS_STRING(items[0]), (size_t)width);
    Py_ssize_t live = 0;
    for (Py_ssize_t j = 0; j < width; j++) live += alive[j] != 0;
    for (Py_ssize_t i = 1; i < end && live; i++) {
        const uint8_t *present = items[i] == Py_None ? NULL : (const uint8_t *)PyBytes_AS_STRING(items[i]);
        Py_ssize_t plen = items[i] == Py_None ? 0 : PyBytes_GET_SIZE(items[i]);
        for (Py_ssize_t j = 0; j < width; j++) {
            uint8_t a = alive[j];
            if (!a) continue;
            uint8_t keep = (uint8_t)(a & (j < plen ? present[j] : 0));
            uint8_t stopped = (uint8_t)(a & ~keep);
            for (int b = 0; stopped; b++, stopped >>= 1) {
                if ((stopped & 1) && emit_prefix(e, 8 * j + b, i) < 0) goto fail;
            }
            alive[j] = keep;
            if (!keep) live--;
        }
    }
    for (Py_ssize_t j = 0; j < width && live; j++) {
        for (int b = 0; b < 8; b++) {
            if ((alive[j] >> b & 1) && emit_prefix(e, 8 * j + b, end) < 0) goto fail;
        }
    }
done:
    PyMem_Free(alive);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(alive);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* prefix_matches(bitmaps, end, names: dict[int, str], tiers: sequence[str], make) -> list: the walk's pods
 * as ``make(name, held, tiers[held - 1])``, numbers without a name left out: the per-pod objects of a
 * fleet-wide prefix built here rather than from a thousand pairs in Python. */
static PyObject *prefix_matches(PyObject *self, PyObject *args) {
    PyObject *maps_obj, *names, *tiers_obj, *make;
    Py_ssize_t end;
    if (!PyArg_ParseTuple(args, "OnO!OO", &maps_obj, &end, &PyDict_Type, &names, &tiers_obj, &make)) return NULL;
    if (!PyCallable_Check(make)) {
        PyErr_SetString(PyExc_TypeError, "make must be callable");
        return NULL;
    }
    PyObject *tiers = PySequence_Fast(tiers_obj, "tiers must be a sequence");
    if (tiers == NULL) return NULL;
    prefix_emit e = {NULL, names, PySequence_Fast_ITEMS(tiers), PySequence_Fast_GET_SIZE(tiers), make};
    PyObject *out = walk_prefixes(maps_obj, end, &e);
    Py_DECREF(tiers);
    return out;
}

/* The attribute names affinities() reads, interned once at import (PyInit__speedups). */
static PyObject *s_pod, *s_blocks, *s_tier, *s_ebs, *s_incomplete;

/* An int as a long long, clamped where it does not fit (a pod's meta may hold any number: scored as the
 * Python loop scores it, never an error for the whole prediction); -1 with an error for a non-int. */
static int as_clamped(PyObject *o, long long *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = overflow > 0 ? LLONG_MAX : overflow < 0 ? LLONG_MIN : v;
    return 0;
}

/* affinities(matches, prompt_len, canonical_block, infos: dict | None, wanted: set | None, estimate, make)
 * -> list: predictor/scoring/score.py's per-pod loop (see there for the rules), the pods unsorted. Each match's
 * ``pod_id``, ``blocks`` and ``tier``, each info's ``engine_block_size`` and ``incomplete`` are read by
 * name; ``estimate(tokens)`` is called once per distinct token count (None: no estimate); an item is
 * ``make(pod_id, blocks, tokens, tier, estimate, incomplete)``. A prompt a whole fleet holds scores a
 * thousand pods per prediction: 0.42 ms in Python, 0.29 ms here (0.12 ms of which the estimate calls). */
static PyObject *affinities(PyObject *self, PyObject *args) {
    PyObject *matches_obj, *infos, *wanted, *estimate, *make;
    long long prompt_len, canonical;
    if (!PyArg_ParseTuple(args, "OLLOOOO", &matches_obj, &prompt_len, &canonical, &infos, &wanted, &estimate, &make))
        return NULL;
    if (infos != Py_None && !PyDict_Check(infos)) {
        PyErr_SetString(PyExc_TypeError, "infos must be a dict or None");
        return NULL;
    }
    if (wanted != Py_None && !PyAnySet_Check(wanted)) {
        PyErr_SetString(PyExc_TypeError, "wanted must be a set or None");
        return NULL;
    }
    if (canonical <= 0) {
        PyErr_SetString(PyExc_ValueError, "canonical_block must be positive");
        return NULL;
    }
    /* A tuple (a list is copied): the callbacks below (estimate, make, attribute reads) cannot resize it
     * under the loop, and each item stays alive while it is read. */
    PyObject *seq = PySequence_Tuple(matches_obj);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    PyObject *out = PyList_New(0), *estimates = PyDict_New();
    PyObject *pod = NULL, *blocks = NULL, *tier = NULL, *ebs = NULL, *partial = NULL, *tokens_obj = NULL;
    PyObject *info = NULL;
    if (out == NULL || estimates == NULL) goto fail;
    long long cap_e = 0, cap = 0;  /* the last engine block size seen and its last-token cap */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = items[i];
        if ((pod = PyObject_GetAttr(m, s_pod)) == NULL) goto fail;
        if (wanted != Py_None) {
            int in = PySet_Contains(wanted, pod);
            if (in < 0) goto fail;
            if (!in) { Py_CLEAR(pod); continue; }
        }
        if ((blocks = PyObject_GetAttr(m, s_blocks)) == NULL) goto fail;
        long long b, e = 0;
        if (as_clamped(blocks, &b) < 0) goto fail;
        if (infos != Py_None) {
            info = PyDict_GetItemWithError(infos, pod);
            if (info == NULL && PyErr_Occurred()) goto fail;
            if (info == Py_None) info = NULL;  /* as no metadata, like the Python loop */
            Py_XINCREF(info);  /* owned: reading its attributes may run code that changes infos */
        }
        if (info != NULL) {
            if ((ebs = PyObject_GetAttr(info, s_ebs)) == NULL) goto fail;
            if (ebs != Py_None && as_clamped(ebs, &e) < 0) goto fail;
            Py_CLEAR(ebs);
            if ((partial = PyObject_GetAttr(info, s_incomplete)) == NULL) goto fail;
            Py_CLEAR(info);
        } else {
            partial = Py_NewRef(Py_False);
        }
        if (e <= 0) e = canonical;
        if (e != cap_e) {
            cap_e = e;
            cap = prompt_len > 1 ? (prompt_len - 1) / e * e : 0;
        }
        /* a count past what any prompt holds (LLONG_MAX / canonical) reuses the whole cap */
        long long tokens = b <= 0 ? 0 : b > LLONG_MAX / canonical ? cap : b * canonical / e * e;
        if (tokens > cap) tokens = cap;
        if (tokens <= 0) {
            Py_CLEAR(pod); Py_CLEAR(blocks); Py_CLEAR(partial);
            continue;
        }
        if ((tokens_obj = PyLong_FromLongLong(tokens)) == NULL) goto fail;
        PyObject *est = Py_None;  /* borrowed */
        if (estimate != Py_None) {
            est = PyDict_GetItemWithError(estimates, tokens_obj);
            if (est == NULL) {
                if (PyErr_Occurred()) goto fail;
                PyObject *fresh = PyObject_CallOneArg(estimate, tokens_obj);
                if (fresh == NULL) goto fail;
                int rc = PyDict_SetItem(estimates, tokens_obj, fresh);
                Py_DECREF(fresh);  /* the dict holds it */
                if (rc < 0) goto fail;
                est = fresh;
            }
        }
        if ((tier = PyObject_GetAttr(m, s_tier)) == NULL) goto fail;
        PyObject *call_args[6] = {pod, blocks, tokens_obj, tier, est, partial};
        PyObject *item = PyObject_Vectorcall(make, call_args, 6, NULL);
        Py_CLEAR(pod); Py_CLEAR(blocks); Py_CLEAR(tokens_obj); Py_CLEAR(tier); Py_CLEAR(partial);
        if (item == NULL) goto fail;
        int rc = PyList_Append(out, item);
        Py_DECREF(item);
        if (rc < 0) goto fail;
    }
    Py_DECREF(estimates);
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(pod); Py_XDECREF(blocks); Py_XDECREF(tokens_obj); Py_XDECREF(tier); Py_XDECREF(ebs);
    Py_XDECREF(partial); Py_XDECREF(info);
    Py_XDECREF(out);
    Py_XDECREF(estimates);
    Py_DECREF(seq);
    return NULL;
}

/* A RESP header ("*<n>\r\n" or "$<n>\r\n") at ``buf``; returns its length (at most 23). */
static size_t put_header(char *buf, char kind, unsigned long long n) {
    char digits[24];
    char *p = write_u64(digits + sizeof digits, n);
    size_t d = (size_t)(digits + sizeof digits - p);
    buf[0] = kind;
    memcpy(buf + 1, p, d);
    buf[d + 1] = '\r';
    buf[d + 2] = '\n';
    return d + 3;
}

/* pack_command(args: list | tuple) -> bytes: one RESP array of bulk strings (a Valkey command).
 * Items: bytes-like, str (UTF-8) or int. The ingester sends thousands of arguments per round
 * trip; this costs ~20 ns each instead of ~0.5 us in Python. */
static PyObject *pack_command(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "args must be a list or tuple");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    size_t cap = 32 + (size_t)n * 40, len = 0;
    char *buf = PyMem_Malloc(cap);
    if (buf == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
    len += put_header(buf, '*', (unsigned long long)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        const char *data;
        Py_ssize_t dlen;
        char num[24];
        Py_buffer view;
        int have_view = 0;
        PyObject *text = NULL;
        if (PyLong_Check(o)) {
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
            char *p;
            if (overflow > 0) {
                unsigned long long u;
                if (as_u64(o, &u) < 0) goto fail;
                p = write_u64(num + sizeof num, u);
            } else if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "int argument out of range");
                goto fail;
            } else if (v < 0) {
                p = write_u64(num + sizeof num, 0ULL - (unsigned long long)v);
                *--p = '-';
            } else {
                p = write_u64(num + sizeof num, (unsigned long long)v);
            }
            data = p;
            dlen = (Py_ssize_t)(num + sizeof num - p);
        } else if (PyUnicode_Check(o)) {
            data = PyUnicode_AsUTF8AndSize(o, &dlen);
            if (data == NULL) goto fail;
        } else if (PyBytes_Check(o)) {
            data = PyBytes_AS_STRING(o);
            dlen = PyBytes_GET_SIZE(o);
        } else if (PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) == 0) {
            have_view = 1;
            data = view.buf;
            dlen = view.len;
        } else {  /* anything else as its str(), as redis-py does for floats */
            PyErr_Clear();
            text = PyObject_Str(o);
            if (text == NULL) goto fail;
            data = PyUnicode_AsUTF8AndSize(text, &dlen);
            if (data == NULL) { Py_DECREF(text); goto fail; }
        }
        if (len + (size_t)dlen + 32 > cap) {
            size_t ncap = cap * 2 > len + (size_t)dlen + 32 ? cap * 2 : len + (size_t)dlen + 96;
            char *nb = PyMem_Realloc(buf, ncap);
            if (nb == NULL) {
                if (have_view) PyBuffer_Release(&view);
                Py_XDECREF(text);
                PyErr_NoMemory();
                goto fail;
            }
            buf = nb;
            cap = ncap;
        }
        len += put_header(buf + len, '$', (unsigned long long)dlen);
        memcpy(buf + len, data, (size_t)dlen);
        len += (size_t)dlen;
        buf[len++] = '\r';
        buf[len++] = '\n';
        if (have_view) PyBuffer_Release(&view);
        Py_XDECREF(text);
    }
    {
        PyObject *out = PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
        PyMem_Free(buf);
        Py_DECREF(seq);
        return out;
    }
fail:
    PyMem_Free(buf);
    Py_DECREF(seq);
    return NULL;
}

/* ---- a pod's delta (kv_preflight/index/pod_log.py encode_delta): its per-mutation columns in one pass */

/* The field slots of the mutation types, looked up once per set of types (held, so their offsets stay theirs). */
static struct {
    PyObject *types[4];  /* StoreBlock, RemoveBlock, ClearPod, MarkIncomplete */
    Py_ssize_t ek, tier, field, rks, group, parentless, parent;  /* StoreBlock's */
    Py_ssize_t r_ek, r_tier, r_group, reason;  /* RemoveBlock's, MarkIncomplete's */
} dslots;

static int delta_slots(PyObject *const *types) {
    if (dslots.types[0] == types[0] && dslots.types[1] == types[1] && dslots.types[2] == types[2]
        && dslots.types[3] == types[3])
        return 1;
    Py_ssize_t o[11] = {
        slot_offset(types[0], "engine_key"), slot_offset(types[0], "tier"), slot_offset(types[0], "entry_field"),
        slot_offset(types[0], "request_keys"), slot_offset(types[0], "group"), slot_offset(types[0], "parentless"),
        slot_offset(types[0], "parent"), slot_offset(types[1], "engine_key"), slot_offset(types[1], "tier"),
        slot_offset(types[1], "group"), slot_offset(types[3], "reason")};
    for (int i = 0; i < 11; i++)
        if (o[i] < 0) return 0;
    for (int i = 0; i < 4; i++) Py_XSETREF(dslots.types[i], Py_NewRef(types[i]));
    dslots.ek = o[0]; dslots.tier = o[1]; dslots.field = o[2]; dslots.rks = o[3]; dslots.group = o[4];
    dslots.parentless = o[5]; dslots.parent = o[6]; dslots.r_ek = o[7]; dslots.r_tier = o[8]; dslots.r_group = o[9];
    dslots.reason = o[10];
    return 1;
}


/* id_of, the last name asked kept at hand (a batch names one field and one tier, mostly as the same object). */
static long long id_at_hand(PyObject *ids, PyObject *s, PyObject **last, long long *last_id) {
    if (s == *last) return *last_id;
    long long v = id_of(ids, NULL, s);
    if (v >= 0) {
        *last = s;
        *last_id = v;
    }
    return v;
}

/* An exact int in [0, 2**64) (as_u64); 0 and no error set for an int outside it, -1 for an error. */
static int u64_or_not(PyObject *o, unsigned long long *out) {
    if (!PyLong_CheckExact(o)) return 0;
    if (as_u64(o, out) == 0) return 1;
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
    PyErr_Clear();
    return 0;
}

/* delta_columns(mutations, StoreBlock, RemoveBlock, ClearPod, MarkIncomplete) -> tuple | None: the columns of
 * pod_log._Delta from ``fields`` to ``reasons`` (fields, tiers, kinds, engine_keys, codes, counts,
 * request_keys, parentless, chained, parents, reasons), the bytes pod_state's Python loop builds, in one pass
 * over a list or tuple of mutations. None where that loop has to decide (it then runs, and raises what it
 * raises): a mutation of another type (a subclass too), a key that is not an int in [0, 2**64), a tier or
 * field that is not a str, a group that is not an int in 0..255, more than 16 tiers, request keys that are
 * not a tuple or list, a parentless that is not a bool, a parent that is not None or an int. The Python loop
 * took ~0.8 us a mutation, a tenth of an ingester's CPU. */
static PyObject *delta_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "delta_columns(mutations, StoreBlock, RemoveBlock, ClearPod, MarkIncomplete)");
        return NULL;
    }
    for (int i = 1; i < 5; i++) {
        if (!PyType_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "delta_columns: the mutation types must be classes");
            return NULL;
        }
    }
    if ((!PyList_CheckExact(args[0]) && !PyTuple_CheckExact(args[0])) || !delta_slots(args + 1)) Py_RETURN_NONE;
    /* A tuple (a list is copied): nothing below runs Python code, but an allocation may run a collection and
     * with it a finalizer; the items stay alive and in place whatever that does. */
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL) return NULL;
    const PyTypeObject *store_t = (PyTypeObject *)args[1], *remove_t = (PyTypeObject *)args[2],
                       *clear_t = (PyTypeObject *)args[3], *flag_t = (PyTypeObject *)args[4];
    Py_ssize_t n = PyTuple_GET_SIZE(seq), nbits = (n + 7) / 8;
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    PyObject *result = NULL, *fids = PyDict_New(), *tids = PyDict_New(), *parents = PyList_New(0),
             *reasons = PyList_New(0);
    PyObject *cols[11] = {NULL};
    /* codes (n), counts (n), engine keys (8n), kinds (n), parentless and chained bits; request keys apart */
    char *mem = PyMem_Calloc(1, (size_t)n * (1 + 8 + 2 * sizeof(long long)) + 2 * (size_t)nbits + 1);
    size_t rk_cap = (size_t)n + 4, n_rks = 0;
    char *rk_buf = PyMem_Malloc(rk_cap * 8);
    if (fids == NULL || tids == NULL || parents == NULL || reasons == NULL) goto done;
    if (mem == NULL || rk_buf == NULL) { PyErr_NoMemory(); goto done; }
    long long *codes = (long long *)mem, *counts = codes + n;  /* (aligned: first) */
    char *ek_buf = (char *)(counts + n), *kinds = ek_buf + 8 * n;
    unsigned char *pl_bits = (unsigned char *)(kinds + n), *ch_bits = pl_bits + nbits;
    Py_ssize_t n_keyed = 0, n_stores = 0;
    PyObject *last_field = NULL, *last_tier = NULL;
    long long last_fid = 0, last_tid = 0;
    int have_last = 0;  /* the previous store's last request key, when it had one */
    unsigned long long last = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = items[i];
        const PyTypeObject *t = Py_TYPE(m);
        if (t == store_t || t == remove_t) {
            int store = t == store_t;
            PyObject *ek = SLOT(m, store ? dslots.ek : dslots.r_ek), *tier = SLOT(m, store ? dslots.tier : dslots.r_tier),
                     *group = SLOT(m, store ? dslots.group : dslots.r_group);
            if (ek == NULL || tier == NULL || group == NULL || !PyUnicode_CheckExact(tier) || !PyLong_CheckExact(group))
                goto fallback;
            unsigned long long key;
            int ok = u64_or_not(ek, &key);
            if (ok <= 0) { if (ok < 0) goto done; goto fallback; }
            int overflow = 0;
            long g = PyLong_AsLongAndOverflow(group, &overflow);
            if (overflow || g < 0 || g > 255) goto fallback;
            long long tid = id_at_hand(tids, tier, &last_tier, &last_tid);
            if (tid < 0) goto done;
            if (PyDict_GET_SIZE(tids) > 16) goto fallback;
            long long code = (long long)g << 4 | tid;
            if (store) {
                PyObject *fld = SLOT(m, dslots.field), *keys = SLOT(m, dslots.rks), *pl = SLOT(m, dslots.parentless),
                         *parent = SLOT(m, dslots.parent);
                if (fld == NULL || keys == NULL || pl == NULL || parent == NULL || !PyUnicode_CheckExact(fld)
                    || (!PyTuple_CheckExact(keys) && !PyList_CheckExact(keys)) || (pl != Py_True && pl != Py_False)
                    || (parent != Py_None && !PyLong_CheckExact(parent)))
                    goto fallback;
                long long fid = id_at_hand(fids, fld, &last_field, &last_fid);
                if (fid < 0) goto done;
                code |= fid << 12;
                Py_ssize_t k = PySequence_Fast_GET_SIZE(keys);
                PyObject **ks = PySequence_Fast_ITEMS(keys);
                if (n_rks + (size_t)k > rk_cap) {
                    size_t cap = 2 * rk_cap > n_rks + (size_t)k ? 2 * rk_cap : n_rks + (size_t)k;
                    char *grown = PyMem_Realloc(rk_buf, cap * 8);
                    if (grown == NULL) { PyErr_NoMemory(); goto done; }
                    rk_buf = grown;
                    rk_cap = cap;
                }
                unsigned long long rk = 0;
                for (Py_ssize_t j = 0; j < k; j++) {
                    ok = u64_or_not(ks[j], &rk);
                    if (ok <= 0) { if (ok < 0) goto done; goto fallback; }
                    put_le(rk_buf + 8 * (n_rks + (size_t)j), rk);
                }
                n_rks += (size_t)k;
                Py_ssize_t s = n_stores++;
                if (pl == Py_True) pl_bits[s >> 3] |= (unsigned char)(1 << (s & 7));
                /* chained: the parent is the previous store's last request key (never CHAIN_ROOT, not a u64) */
                int chained = 0;
                unsigned long long p;
                if (parent != Py_None && have_last) {
                    ok = u64_or_not(parent, &p);
                    if (ok < 0) goto done;
                    chained = ok && p == last;
                }
                if (chained) ch_bits[s >> 3] |= (unsigned char)(1 << (s & 7));
                else if (PyList_Append(parents, parent) < 0) goto done;
                have_last = k > 0;
                last = rk;
                counts[s] = k;
            }
            kinds[i] = store ? 0 : 1;
            put_le(ek_buf + 8 * n_keyed, key);
            codes[n_keyed++] = code;
        } else if (t == clear_t) {
            kinds[i] = 2;
        } else if (t == flag_t) {
            PyObject *reason = SLOT(m, dslots.reason);
            if (reason == NULL) goto fallback;
            if (PyList_Append(reasons, reason) < 0) goto done;
            kinds[i] = 3;
        } else {
            goto fallback;
        }
    }
    if ((cols[0] = PyDict_Keys(fids)) == NULL || (cols[1] = PyDict_Keys(tids)) == NULL
        || (cols[2] = PyBytes_FromStringAndSize(kinds, n)) == NULL
        || (cols[3] = PyBytes_FromStringAndSize(ek_buf, 8 * n_keyed)) == NULL
        || (cols[4] = column_of(codes, n_keyed)) == NULL || (cols[5] = column_of(counts, n_stores)) == NULL
        || (cols[6] = PyBytes_FromStringAndSize(rk_buf, (Py_ssize_t)(8 * n_rks))) == NULL
        || (cols[7] = PyBytes_FromStringAndSize((char *)pl_bits, (n_stores + 7) / 8)) == NULL
        || (cols[8] = PyBytes_FromStringAndSize((char *)ch_bits, (n_stores + 7) / 8)) == NULL)
        goto done;
    cols[9] = Py_NewRef(parents);
    cols[10] = Py_NewRef(reasons);
    if ((result = PyTuple_New(11)) == NULL) goto done;
    for (int i = 0; i < 11; i++) {
        PyTuple_SET_ITEM(result, i, cols[i]);  /* steals */
        cols[i] = NULL;
    }
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 11; i++) Py_XDECREF(cols[i]);
    PyMem_Free(mem);
    PyMem_Free(rk_buf);
    Py_XDECREF(fids); Py_XDECREF(tids); Py_XDECREF(parents); Py_XDECREF(reasons);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"request_keys", request_keys, METH_VARARGS,
     "Chained llm-d request keys for the full blocks of tokens (extra = nil)."},
    {"request_keys_json", request_keys_json, METH_VARARGS,
     "Request keys and token count straight from the JSON text of a token-id array."},
    {"member_span", member_span, METH_VARARGS,
     "(start, end) of the value of a JSON object's top-level member, found by one skipping pass; None if not once."},
    {"pack_command", pack_command, METH_O,
     "One RESP command (array of bulk strings) from a list of bytes, str and int."},
    {"pack_u64s", pack_u64s, METH_O,
     "Ints as little-endian uint64s, concatenated (struct.pack('<nQ', ...) without its per-value cost)."},
    {"snapshot_columns", snapshot_columns, METH_O,
     "A pod state's per-block snapshot columns (pod_log._columns), in one pass over its blocks."},
    {"pack_keys", pack_keys, METH_O,
     "Keys as fixed-width (20) right-aligned decimal, concatenated: one argument for the lookup script."},
    {"prefix_matches", prefix_matches, METH_VARARGS,
     "Per pod a chain's first key holds, make(name, held, tiers[held - 1]): how many leading keys it holds, "
     "from one pod bitmap per key; numbers without a name left out."},
    {"affinities", affinities, METH_VARARGS,
     "predictor/scoring/score.py's per-pod loop: make(pod, blocks, tokens, tier, estimate, incomplete) per scoring pod."},
    {"delta_columns", (PyCFunction)(void (*)(void))delta_columns, METH_FASTCALL,
     "pod_log.encode_delta's per-mutation columns in one pass; None where its Python loop has to decide."},
    {"slot_groups", slot_groups, METH_VARARGS,
     "Positions of keys named prefix + decimal value (request keys: no prefix) grouped by the shard serving "
     "each name's cluster slot (a slot -> shard table); the prefix holds no hash tag."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups", NULL, -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    crc16_init();
    if (s_pod == NULL) {
        s_pod = PyUnicode_InternFromString("pod_id");
        s_blocks = PyUnicode_InternFromString("blocks");
        s_tier = PyUnicode_InternFromString("tier");
        s_ebs = PyUnicode_InternFromString("engine_block_size");
        s_incomplete = PyUnicode_InternFromString("incomplete");
        s_field = PyUnicode_InternFromString("field");
        s_rks = PyUnicode_InternFromString("rks");
        s_parent = PyUnicode_InternFromString("parent");
        s_copies = PyUnicode_InternFromString("copies");
        if (!s_pod || !s_blocks || !s_tier || !s_ebs || !s_incomplete || !s_field || !s_rks || !s_parent || !s_copies) {
            Py_CLEAR(s_pod); Py_CLEAR(s_blocks); Py_CLEAR(s_tier); Py_CLEAR(s_ebs); Py_CLEAR(s_incomplete);
            Py_CLEAR(s_field); Py_CLEAR(s_rks); Py_CLEAR(s_parent); Py_CLEAR(s_copies);
            return NULL;
        }
    }
    return PyModule_Create(&module);
}
