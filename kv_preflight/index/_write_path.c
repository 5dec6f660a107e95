/*
 * The write path's per-block loops, in C: what an ingester does for every engine block it writes.
 *
 * - PodState.plan's loop over stores and removals (kv_preflight/index/pod_state.py): every stored or evicted
 *   engine block moves a dozen reference counts in the pod's state (its blocks, engine-key slots, entry and bit
 *   refs, the orphan count's links) and emits the KeyChange / EngineAdd / EngineDrop the backends write. In
 *   Python that was ~8 us a block, the ingester's largest cost; here it is the same dict operations on the same
 *   Python dicts without the interpreter around them, so the state stays the Python object every other reader
 *   (clone, snapshot, restore, export) knows.
 * - A plan's changes as changes.lua's arguments (kv_preflight/index/changes.py change_args, shard_args) and a
 *   Valkey Cluster run's rounds read off its outbox entries' changes (kv_preflight/index/cluster/outbox_ops.py, run
 *   by writes.py): a list item or a command per block each.
 *
 * The Python functions stay the reference and the fallback when this module is not built, and take whatever
 * is not the usual case (each C routine answers None for it); tests/unit/test_pod_state.py, test_changes.py and
 * test_cluster_run_ops.py hold each pair equal on random input. Each function here mirrors the Python of the
 * same name. The plan loop's rare paths (an engine key whose drop waits for another of the pod's blocks, a bit
 * name not yet cached) call back into the Python methods rather than repeating them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "../_u64.h"

/* Attribute names, interned once at import. */
static PyObject *s_blocks, *s_tiers, *s_entry_refs, *s_bit_refs, *s_ek_slots, *s_ek_refs, *s_rk_links,
    *s_deferred, *s_waiting, *s_held, *s_known, *s_kids, *s_parent_of, *s_bits_cache, *s_prefix, *s_unknown,
    *s_orphans, *s_engine_key, *s_tier, *s_entry_field, *s_request_keys, *s_group, *s_parentless, *s_parent,
    *s_field, *s_rks, *s_copies, *s_changes, *s_stored, *s_removed, *s_bit_of, *s_undefer, *s_defer,
    *s_release;

typedef struct {
    PyObject *state, *out, *changes;
    PyObject *blocks, *tiers, *entry_refs, *bit_refs, *ek_slots, *ek_refs, *rk_links, *deferred, *waiting,
        *held, *known, *kids, *parent_of, *bits_cache, *prefix;
    long long unknown, orphans, stored, removed;
    PyTypeObject *store_type, *remove_type, *key_change, *engine_add, *engine_drop;
    PyObject *block_type;
} Planner;

/* d.get(k, 0) as a long long */
static int dget(PyObject *d, PyObject *k, long long *v) {
    PyObject *o = PyDict_GetItemWithError(d, k);
    if (o == NULL) {
        *v = 0;
        return PyErr_Occurred() ? -1 : 0;
    }
    *v = PyLong_AsLongLong(o);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* A KeyError of ``k`` as Python's d[k] raises it (KeyError((ek, group)), not KeyError(ek, group), for a tuple) */
static void key_error(PyObject *k) {
    PyObject *args = PyTuple_Pack(1, k);
    if (args == NULL) return;
    PyErr_SetObject(PyExc_KeyError, args);
    Py_DECREF(args);
}

/* d[k] (a KeyError when missing, as Python's d[k]) as a long long */
static int dneed(PyObject *d, PyObject *k, long long *v) {
    PyObject *o = PyDict_GetItemWithError(d, k);
    if (o == NULL) {
        if (!PyErr_Occurred()) key_error(k);
        return -1;
    }
    *v = PyLong_AsLongLong(o);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* o[k] = v or o.k = v (``set``: PyDict_SetItem or PyObject_SetAttr), v made an int */
static int set_int(int (*set)(PyObject *, PyObject *, PyObject *), PyObject *o, PyObject *k, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    if (x == NULL) return -1;
    int r = set(o, k, x);
    Py_DECREF(x);
    return r;
}

static int dput(PyObject *d, PyObject *k, long long v) {
    return set_int(PyDict_SetItem, d, k, v);
}

/* d.pop(k, None) */
static int dpop(PyObject *d, PyObject *k) {
    if (PyDict_DelItem(d, k) == 0) return 0;
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
    PyErr_Clear();
    return 0;
}

/* parent == CHAIN_ROOT (-1) */
static int is_root(PyObject *o) {
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        return !overflow && v == -1;
    }
    PyObject *root = PyLong_FromLong(-1);
    if (root == NULL) return -1;
    int r = PyObject_RichCompareBool(o, root, Py_EQ);
    Py_DECREF(root);
    return r;
}

/* An instance of a NamedTuple class (a tuple subtype without a __dict__), filled as tuple.__new__ fills one. */
static int emit(Planner *p, PyTypeObject *type, Py_ssize_t n, PyObject **items) {
    PyObject *t = type->tp_alloc(type, n);
    if (t == NULL) {
        for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(items[i]);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);  /* steals */
    int r = PyList_Append(p->changes, t);
    Py_DECREF(t);
    return r;
}

static int call2(PyObject *state, PyObject *name, PyObject *a, PyObject *b) {
    PyObject *args[3] = {state, a, b};
    PyObject *r = PyObject_VectorcallMethod(name, args, (b ? 3 : 2) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* PodState.bit_of: the cached answer, or the Python method (which caches it). New reference. */
static PyObject *bit_of(Planner *p, PyObject *fld, PyObject *group) {
    PyObject *k = PyTuple_Pack(2, fld, group);
    if (k == NULL) return NULL;
    PyObject *bit = PyDict_GetItemWithError(p->bits_cache, k);
    Py_DECREF(k);
    if (bit != NULL) return Py_NewRef(bit);
    if (PyErr_Occurred()) return NULL;
    PyObject *args[3] = {p->state, fld, group};
    return PyObject_VectorcallMethod(s_bit_of, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* A (key, refs) counter moved by d, the key removed at 0: +1 on the first link, -1 on the last unlink. */
static int refs(PyObject *d, PyObject *a, PyObject *b, int delta, int *change) {
    PyObject *k = PyTuple_Pack(2, a, b);
    if (k == NULL) return -1;
    long long n;
    int r = dget(d, k, &n);
    if (r == 0) {
        n += delta;
        if (n <= 0) {
            r = dpop(d, k);
            *change = -1;
        } else {
            r = dput(d, k, n);
            *change = (n == 1 && delta > 0) ? 1 : 0;
        }
    }
    Py_DECREF(k);
    return r;
}

static int add_parent(Planner *p, PyObject *rk, PyObject *parent) {
    if (PyDict_SetItem(p->parent_of, rk, parent) < 0) return -1;
    int root = is_root(parent);
    if (root < 0) return -1;
    if (!root) {
        long long kids, held;
        if (dget(p->kids, parent, &kids) < 0 || dput(p->kids, parent, kids + 1) < 0) return -1;
        if (dget(p->held, parent, &held) < 0) return -1;
        if (!held) p->orphans += 1;
    }
    return 0;
}

static int drop_parent(Planner *p, PyObject *rk) {
    PyObject *parent = PyDict_GetItemWithError(p->parent_of, rk);
    if (parent == NULL) {
        if (!PyErr_Occurred()) key_error(rk);
        return -1;
    }
    Py_INCREF(parent);
    int r = PyDict_DelItem(p->parent_of, rk);
    int root = r < 0 ? -1 : is_root(parent);
    if (root == 0) {
        long long kids, held;
        r = dneed(p->kids, parent, &kids);
        if (r == 0) r = kids - 1 ? dput(p->kids, parent, kids - 1) : PyDict_DelItem(p->kids, parent);
        if (r == 0) r = dget(p->held, parent, &held);
        if (r == 0 && !held) p->orphans -= 1;
    } else if (root < 0) {
        r = -1;
    }
    Py_DECREF(parent);
    return r;
}

static int prefix_link(Planner *p, PyObject *rk, PyObject *parent, int d) {
    long long links, known, kids;
    if (dget(p->held, rk, &links) < 0 || dget(p->known, rk, &known) < 0) return -1;
    int unknown_parent = parent == Py_None;
    if (d > 0) {
        if (dput(p->held, rk, links + 1) < 0) return -1;
        if (!unknown_parent && dput(p->known, rk, known + 1) < 0) return -1;
        if (links == 0) {
            if (dget(p->kids, rk, &kids) < 0) return -1;
            p->orphans -= kids;
            if (unknown_parent) p->unknown += 1;
            else if (add_parent(p, rk, parent) < 0) return -1;
        } else if (known == 0 && !unknown_parent) {
            p->unknown -= 1;
            if (add_parent(p, rk, parent) < 0) return -1;
        }
        return 0;
    }
    if (links <= 1) {
        if (dpop(p->held, rk) < 0 || dpop(p->known, rk) < 0) return -1;
        if (dget(p->kids, rk, &kids) < 0) return -1;
        p->orphans += kids;
        if (known) return drop_parent(p, rk);
        p->unknown -= 1;
        return 0;
    }
    if (dput(p->held, rk, links - 1) < 0) return -1;
    if (!unknown_parent) {
        if (known <= 1) {
            if (dpop(p->known, rk) < 0 || drop_parent(p, rk) < 0) return -1;
            p->unknown += 1;
        } else if (dput(p->known, rk, known - 1) < 0) {
            return -1;
        }
    }
    return 0;
}

static int link_key(Planner *p, PyObject *rk, PyObject *fld, PyObject *bit, int has_bit, int d, int prefix,
                PyObject *parent) {
    long long links;
    if (dget(p->rk_links, rk, &links) < 0) return -1;
    links += d;
    if ((links > 0 ? dput(p->rk_links, rk, links) : dpop(p->rk_links, rk)) < 0) return -1;
    int entry = 0, bit_delta = 0;
    if (refs(p->entry_refs, rk, fld, d, &entry) < 0) return -1;
    if (has_bit && refs(p->bit_refs, rk, bit, d, &bit_delta) < 0) return -1;
    if (entry || bit_delta) {
        PyObject *items[5] = {Py_NewRef(rk), Py_NewRef(fld), PyLong_FromLong(entry), Py_NewRef(bit),
                              PyLong_FromLong(bit_delta)};
        if (items[2] == NULL || items[4] == NULL) {
            for (int i = 0; i < 5; i++) Py_XDECREF(items[i]);
            return -1;
        }
        if (emit(p, p->key_change, 5, items) < 0) return -1;
    }
    if (prefix && has_bit && prefix_link(p, rk, parent, d) < 0) return -1;
    if (links <= 0 && PyDict_GET_SIZE(p->waiting)) {
        int in = PyDict_Contains(p->waiting, rk);
        if (in < 0 || (in && call2(p->state, s_release, rk, p->out) < 0)) return -1;
    }
    return 0;
}

/* ek_slots[(ek, group)] moved by d: +1 from 0 when missing; -1 a KeyError when missing, removed at 0 */
static int move_slot(Planner *p, PyObject *ek, PyObject *group, int d) {
    PyObject *k = PyTuple_Pack(2, ek, group);
    if (k == NULL) return -1;
    long long v;
    int r = d > 0 ? dget(p->ek_slots, k, &v) : dneed(p->ek_slots, k, &v);
    if (r == 0) r = v + d ? dput(p->ek_slots, k, v + d) : PyDict_DelItem(p->ek_slots, k);
    Py_DECREF(k);
    return r;
}

static int link_engine(Planner *p, PyObject *ek, PyObject *group, PyObject *rks) {
    long long n;
    if (move_slot(p, ek, group, +1) < 0 || dget(p->ek_refs, ek, &n) < 0 || dput(p->ek_refs, ek, n + 1) < 0) return -1;
    if (n == 0) {
        if (PyDict_GET_SIZE(p->deferred)) {
            int in = PyDict_Contains(p->deferred, ek);
            if (in < 0 || (in && call2(p->state, s_undefer, ek, NULL) < 0)) return -1;
        }
        if (PyTuple_GET_SIZE(rks)) {
            PyObject *items[2] = {Py_NewRef(ek), Py_NewRef(rks)};
            return emit(p, p->engine_add, 2, items);
        }
    }
    return 0;
}

static int unlink_engine(Planner *p, PyObject *ek, PyObject *group, PyObject *rks) {
    long long n;
    if (move_slot(p, ek, group, -1) < 0 || dneed(p->ek_refs, ek, &n) < 0) return -1;
    if (n - 1) return dput(p->ek_refs, ek, n - 1);
    if (PyDict_DelItem(p->ek_refs, ek) < 0) return -1;
    Py_ssize_t m = PyTuple_GET_SIZE(rks);
    for (Py_ssize_t i = 0; i < m; i++) {
        long long links;
        if (dget(p->rk_links, PyTuple_GET_ITEM(rks, i), &links) < 0) return -1;
        if (links) return call2(p->state, s_defer, ek, rks);
    }
    if (m) {
        PyObject *items[2] = {Py_NewRef(ek), Py_NewRef(rks)};
        return emit(p, p->engine_drop, 2, items);
    }
    return 0;
}

/* The links of a block's request keys, each key's parent the block's parent, then the key before it. */
static int link_all(Planner *p, PyObject *rks, PyObject *fld, PyObject *group, PyObject *parent, int d) {
    PyObject *bit = bit_of(p, fld, group);
    if (bit == NULL) return -1;
    int has_bit = PyObject_IsTrue(bit);
    int prefix = PyObject_RichCompareBool(group, p->prefix, Py_EQ);
    int r = (has_bit < 0 || prefix < 0) ? -1 : 0;
    Py_ssize_t m = PyTuple_GET_SIZE(rks);
    for (Py_ssize_t i = 0; i < m && r == 0; i++) {
        PyObject *rk = PyTuple_GET_ITEM(rks, i);
        r = link_key(p, rk, fld, bit, has_bit, d, prefix, parent);
        parent = rk;
    }
    Py_DECREF(bit);
    return r;
}

static int dput_attr(PyObject *held, long long v) {
    return set_int(PyObject_SetAttr, held, s_copies, v);
}

/* The held block's copies (in *now), moved by d */
static int add_copies(PyObject *held, long long d, long long *now) {
    PyObject *c = PyObject_GetAttr(held, s_copies);
    if (c == NULL) return -1;
    *now = PyLong_AsLongLong(c);
    Py_DECREF(c);
    if (*now == -1 && PyErr_Occurred()) return -1;
    return d ? dput_attr(held, *now + d) : 0;
}

static int store(Planner *p, PyObject *m) {
    PyObject *ek = NULL, *tier = NULL, *group = NULL, *bk = NULL, *parent = NULL, *rks = NULL, *fld = NULL;
    PyObject *block = NULL;
    int r = -1;
    if ((ek = PyObject_GetAttr(m, s_engine_key)) == NULL || (tier = PyObject_GetAttr(m, s_tier)) == NULL
        || (group = PyObject_GetAttr(m, s_group)) == NULL || (bk = PyTuple_Pack(3, ek, tier, group)) == NULL)
        goto done;
    PyObject *held = PyDict_GetItemWithError(p->blocks, bk);
    if (held != NULL) {  /* another physical copy of a held hash (its eviction comes once per copy) */
        long long copies;
        if (add_copies(held, 1, &copies) < 0) goto done;
        p->stored += 1;
        r = 0;
        goto done;
    }
    if (PyErr_Occurred()) goto done;
    PyObject *keys;
    if ((parent = PyObject_GetAttr(m, s_parent)) == NULL || (fld = PyObject_GetAttr(m, s_entry_field)) == NULL
        || (keys = PyObject_GetAttr(m, s_request_keys)) == NULL)
        goto done;
    rks = PyTuple_CheckExact(keys) ? keys : PySequence_Tuple(keys);
    if (rks != keys) Py_DECREF(keys);
    if (rks == NULL) goto done;
    PyObject *args[3] = {fld, rks, parent};
    if ((block = PyObject_Vectorcall(p->block_type, args, 3, NULL)) == NULL) goto done;
    if (PyDict_SetItem(p->blocks, bk, block) < 0 || PySet_Add(p->tiers, tier) < 0) goto done;
    if (link_engine(p, ek, group, rks) < 0 || link_all(p, rks, fld, group, parent, +1) < 0) goto done;
    p->stored += 1;
    r = 0;
done:
    Py_XDECREF(ek); Py_XDECREF(tier); Py_XDECREF(group); Py_XDECREF(bk); Py_XDECREF(parent); Py_XDECREF(rks);
    Py_XDECREF(fld); Py_XDECREF(block);
    return r;
}

static int drop(Planner *p, PyObject *bk, PyObject *held) {
    PyObject *ek = PyTuple_GET_ITEM(bk, 0), *group = PyTuple_GET_ITEM(bk, 2);
    PyObject *fld = NULL, *rks = NULL, *parent = NULL;
    int r = -1;
    if ((fld = PyObject_GetAttr(held, s_field)) == NULL || (rks = PyObject_GetAttr(held, s_rks)) == NULL
        || (parent = PyObject_GetAttr(held, s_parent)) == NULL)
        goto done;
    if (!PyTuple_Check(rks)) {
        PyErr_SetString(PyExc_TypeError, "a held block's request keys must be a tuple");
        goto done;
    }
    if (PyDict_DelItem(p->blocks, bk) < 0) goto done;
    if (link_all(p, rks, fld, group, parent, -1) < 0 || unlink_engine(p, ek, group, rks) < 0) goto done;
    r = 0;
done:
    Py_XDECREF(fld); Py_XDECREF(rks); Py_XDECREF(parent);
    return r;
}

static int remove_block(Planner *p, PyObject *m) {
    PyObject *ek = NULL, *tier = NULL, *group = NULL, *bk = NULL, *held = NULL;
    int r = -1;
    if ((ek = PyObject_GetAttr(m, s_engine_key)) == NULL || (tier = PyObject_GetAttr(m, s_tier)) == NULL
        || (group = PyObject_GetAttr(m, s_group)) == NULL || (bk = PyTuple_Pack(3, ek, tier, group)) == NULL)
        goto done;
    held = PyDict_GetItemWithError(p->blocks, bk);
    if (held == NULL) {
        r = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    Py_INCREF(held);  /* the dict's reference goes with the block */
    p->removed += 1;
    long long copies;
    if (add_copies(held, 0, &copies) < 0) goto done;
    if (copies > 1) {
        r = dput_attr(held, copies - 1);
        goto done;
    }
    r = drop(p, bk, held);
done:
    Py_XDECREF(ek); Py_XDECREF(tier); Py_XDECREF(group); Py_XDECREF(bk); Py_XDECREF(held);
    return r;
}

static PyObject *attr(PyObject *o, PyObject *name, int dict) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v != NULL && dict && !PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError, "PodState.%U must be a dict", name);
        Py_CLEAR(v);
    }
    return v;
}

static int load_count(PyObject *o, PyObject *name, long long *v) {
    PyObject *x = PyObject_GetAttr(o, name);
    if (x == NULL) return -1;
    *v = PyLong_AsLongLong(x);
    Py_DECREF(x);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int save_count(PyObject *o, PyObject *name, long long v) {
    return set_int(PyObject_SetAttr, o, name, v);
}

/* plan_blocks(state, out, mutations, start, reannouncements, types) -> int: PodState.plan's loop from
 * ``start`` over the StoreBlock and RemoveBlock mutations it meets (``types``: StoreBlock, RemoveBlock,
 * _Block, KeyChange, EngineAdd, EngineDrop), stopping at the first it leaves to Python (a clear, a flag, any
 * other type, and with ``reannouncements`` a parentless store from a chain's start, whose run Python judges):
 * returns that mutation's index (len(mutations) when none). The state moves in place and ``out`` gains the
 * changes and the stored/removed counts, as the Python methods would leave them, also when an error stops it
 * halfway. */
static PyObject *plan_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *state, *out, *muts_obj, *types;
    Py_ssize_t start;
    int reannounce;
    if (!PyArg_ParseTuple(args, "OOOnpO!", &state, &out, &muts_obj, &start, &reannounce, &PyTuple_Type, &types))
        return NULL;
    if (PyTuple_GET_SIZE(types) != 6) {
        PyErr_SetString(PyExc_TypeError, "types must be (StoreBlock, RemoveBlock, _Block, KeyChange, EngineAdd, EngineDrop)");
        return NULL;
    }
    for (int i = 0; i < 6; i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
            PyErr_SetString(PyExc_TypeError, "types must be classes");
            return NULL;
        }
    }
    for (int i = 3; i < 6; i++) {
        PyTypeObject *t = (PyTypeObject *)PyTuple_GET_ITEM(types, i);
        if (!PyType_IsSubtype(t, &PyTuple_Type) || t->tp_dictoffset != 0) {
            PyErr_SetString(PyExc_TypeError, "the change types must be NamedTuples");
            return NULL;
        }
    }
    Planner p = {0};
    p.state = state;
    p.out = out;
    p.store_type = (PyTypeObject *)PyTuple_GET_ITEM(types, 0);
    p.remove_type = (PyTypeObject *)PyTuple_GET_ITEM(types, 1);
    p.block_type = PyTuple_GET_ITEM(types, 2);
    p.key_change = (PyTypeObject *)PyTuple_GET_ITEM(types, 3);
    p.engine_add = (PyTypeObject *)PyTuple_GET_ITEM(types, 4);
    p.engine_drop = (PyTypeObject *)PyTuple_GET_ITEM(types, 5);
    PyObject *muts = PySequence_Fast(muts_obj, "mutations must be a sequence");
    PyObject *result = NULL;
    int loaded = 0;
    if (muts == NULL) return NULL;
    if ((p.changes = PyObject_GetAttr(out, s_changes)) == NULL) goto done;
    if (!PyList_Check(p.changes)) {
        PyErr_SetString(PyExc_TypeError, "Plan.changes must be a list");
        goto done;
    }
    if ((p.blocks = attr(state, s_blocks, 1)) == NULL || (p.tiers = attr(state, s_tiers, 0)) == NULL
        || (p.entry_refs = attr(state, s_entry_refs, 1)) == NULL || (p.bit_refs = attr(state, s_bit_refs, 1)) == NULL
        || (p.ek_slots = attr(state, s_ek_slots, 1)) == NULL || (p.ek_refs = attr(state, s_ek_refs, 1)) == NULL
        || (p.rk_links = attr(state, s_rk_links, 1)) == NULL || (p.deferred = attr(state, s_deferred, 1)) == NULL
        || (p.waiting = attr(state, s_waiting, 1)) == NULL || (p.held = attr(state, s_held, 1)) == NULL
        || (p.known = attr(state, s_known, 1)) == NULL || (p.kids = attr(state, s_kids, 1)) == NULL
        || (p.parent_of = attr(state, s_parent_of, 1)) == NULL
        || (p.bits_cache = attr(state, s_bits_cache, 1)) == NULL || (p.prefix = attr(state, s_prefix, 0)) == NULL)
        goto done;
    if (!PyAnySet_Check(p.tiers)) {
        PyErr_SetString(PyExc_TypeError, "PodState.tiers must be a set");
        goto done;
    }
    if (load_count(state, s_unknown, &p.unknown) < 0 || load_count(state, s_orphans, &p.orphans) < 0) goto done;
    loaded = 1;
    /* the size and item read afresh each time, the item held: the callbacks into Python (_release, _undefer,
     * _defer, bit_of) may change a list of mutations, even free its items */
    Py_ssize_t i = start < 0 ? 0 : start;
    int failed = 0;
    for (; i < PySequence_Fast_GET_SIZE(muts) && !failed; i++) {
        PyObject *m = PySequence_Fast_GET_ITEM(muts, i);
        PyTypeObject *t = Py_TYPE(m);
        Py_INCREF(m);
        if (t == p.store_type) {
            if (reannounce) {
                PyObject *pl = PyObject_GetAttr(m, s_parentless);
                int parentless = pl == NULL ? -1 : PyObject_IsTrue(pl);
                Py_XDECREF(pl);
                if (parentless < 0) { Py_DECREF(m); failed = 1; break; }
                if (parentless) {
                    PyObject *parent = PyObject_GetAttr(m, s_parent);
                    int stop = parent == NULL ? -1 : parent == Py_None ? 1 : is_root(parent);
                    Py_XDECREF(parent);
                    if (stop) Py_DECREF(m);
                    if (stop < 0) { failed = 1; break; }
                    if (stop) break;
                }
            }
            failed = store(&p, m) < 0;
        } else if (t == p.remove_type) {
            failed = remove_block(&p, m) < 0;
        } else {
            Py_DECREF(m);
            break;
        }
        Py_DECREF(m);
    }
    if (!failed) result = PyLong_FromSsize_t(i);
done:
    if (loaded) {
        /* the counts as far as the loop went (the Python methods move them as they go); an error stays the error */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        long long stored = 0, removed = 0;
        int bad = save_count(state, s_unknown, p.unknown) < 0 || save_count(state, s_orphans, p.orphans) < 0
                  || load_count(out, s_stored, &stored) < 0 || save_count(out, s_stored, stored + p.stored) < 0
                  || load_count(out, s_removed, &removed) < 0 || save_count(out, s_removed, removed + p.removed) < 0;
        if (et != NULL) {
            if (bad) PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
        if (bad || et != NULL) Py_CLEAR(result);
    }
    Py_DECREF(muts);
    Py_XDECREF(p.changes); Py_XDECREF(p.blocks); Py_XDECREF(p.tiers); Py_XDECREF(p.entry_refs);
    Py_XDECREF(p.bit_refs); Py_XDECREF(p.ek_slots); Py_XDECREF(p.ek_refs); Py_XDECREF(p.rk_links);
    Py_XDECREF(p.deferred); Py_XDECREF(p.waiting); Py_XDECREF(p.held); Py_XDECREF(p.known); Py_XDECREF(p.kids);
    Py_XDECREF(p.parent_of); Py_XDECREF(p.bits_cache); Py_XDECREF(p.prefix);
    return result;
}

/* ---- a Valkey Cluster shard's share of a run's changes as changes.lua's arguments (changes.py shard_args) */

/* changes.py _runs: an entry and its bit that come or go together (or an entry with no bit); -1: not ints */
static int runs_of(PyObject *entry_obj, PyObject *bit, PyObject *delta, long *entry) {
    int overflow = 0;
    long e = PyLong_Check(entry_obj) ? PyLong_AsLongAndOverflow(entry_obj, &overflow) : 0;
    if (!PyLong_Check(entry_obj) || overflow || !PyLong_Check(delta) || !PyUnicode_Check(bit)) return -1;
    long d = PyLong_AsLongAndOverflow(delta, &overflow);
    if (overflow) return -1;
    *entry = e;
    return e != 0 && (PyUnicode_GET_LENGTH(bit) ? d == e : d == 0);
}

/* the same of a KeyChange (rk, field, entry, bit, bit_delta) */
static int key_runs(PyObject *c, long *entry) {
    return runs_of(PyTuple_GET_ITEM(c, 2), PyTuple_GET_ITEM(c, 3), PyTuple_GET_ITEM(c, 4), entry);
}

/* "<prefix><rk><suffix>" (layout.presence_key), or NULL with no error when rk is not a uint64 */
static PyObject *key_name(PyObject *rk, const char *prefix, Py_ssize_t np, const char *suffix, Py_ssize_t ns) {
    unsigned long long v;
    if (!PyLong_CheckExact(rk)) return NULL;
    if (as_u64(rk, &v) < 0) {
        PyErr_Clear();
        return NULL;
    }
    char digits[20];
    char *d = write_u64(digits + sizeof digits, v);
    Py_ssize_t nd = digits + sizeof digits - d;
    PyObject *s = PyUnicode_New(np + nd + ns, 127);
    if (s == NULL) return NULL;
    char *w = (char *)PyUnicode_DATA(s);
    memcpy(w, prefix, np);
    memcpy(w + np, d, nd);
    memcpy(w + np + nd, suffix, ns);
    return s;
}

static int append_new(PyObject *list, PyObject *o) {
    if (o == NULL) return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

/* A change's pod (its OutboxEntry: num, sibs, ...) as C reads it: 1 with ``num`` set for a pod numbered within a
 * long and no sibling bits, 0 for anything else (Python's), -1 on an error */
static int plain_pod(PyObject *pod, long *num) {
    if (!PyTuple_Check(pod) || PyTuple_GET_SIZE(pod) < 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(pod, 0))
        || !PyBytes_CheckExact(PyTuple_GET_ITEM(pod, 1)) || PyBytes_GET_SIZE(PyTuple_GET_ITEM(pod, 1)) != 0)
        return 0;
    int overflow = 0;
    *num = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(pod, 0), &overflow);
    if (*num == -1 && PyErr_Occurred()) return -1;
    return !overflow && *num >= 0;
}

/* shard_args(ops, whose, mine, key_prefix, key_suffix, types) -> (args, owners, folded) | None: changes.py
 * shard_args (its reference, see there), for ops of the two kinds a shard mostly gets: KeyChanges whose entry and
 * bit come or go together (s and r runs under F) of pods with no sibling ranks (``whose``: per op, its OutboxEntry)
 * and drops' probes. None, with nothing else done, for anything else (a change in the general form, a pod with
 * sibling ranks, an op of another type, a key outside uint64): Python then builds the whole share.
 * ``mine(num)``: changes.py mine; the key names are key_prefix + decimal + key_suffix (ASCII); ``types``:
 * (KeyChange, Probe). Fields, keys and numbers must be of the exact str, int and bytes types, so that no comparison
 * below runs Python code (which could change the lists read). */
static PyObject *shard_args(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ops_obj, *whose, *mine, *types;
    const char *prefix, *suffix;
    Py_ssize_t np, ns;
    if (!PyArg_ParseTuple(args, "OOOs#s#O!", &ops_obj, &whose, &mine, &prefix, &np, &suffix, &ns, &PyTuple_Type,
                          &types))
        return NULL;
    if (PyTuple_GET_SIZE(types) != 2) {
        PyErr_SetString(PyExc_TypeError, "types must be (KeyChange, Probe)");
        return NULL;
    }
    PyObject *kc = PyTuple_GET_ITEM(types, 0), *pt = PyTuple_GET_ITEM(types, 1);
    if (!PyList_Check(ops_obj) || !PyList_Check(whose) || PyList_GET_SIZE(whose) != PyList_GET_SIZE(ops_obj))
        Py_RETURN_NONE;
    PyObject *out = PyList_New(0), *owners = PyList_New(0), *folded = PyDict_New(), *owns = PyDict_New();
    PyObject *result = NULL, *s_name = PyUnicode_FromString("s"), *r_name = PyUnicode_FromString("r");
    PyObject *f_name = PyUnicode_FromString("F"), *q_name = PyUnicode_FromString("q");
    if (!out || !owners || !folded || !owns || !s_name || !r_name || !f_name || !q_name) goto done;
    PyObject *reg_field = NULL, *reg_bit = NULL;  /* the F op's field and bit, as last sent, and its pod: */
    long reg_num = -1;
    Py_ssize_t run_at = -1, run_len = 0;
    char run_name = 0;
    int unusual = 0;
    Py_ssize_t n = PyList_GET_SIZE(ops_obj);
    for (Py_ssize_t i = 0; i < n && !unusual; i++) {
        PyObject *op = PyList_GET_ITEM(ops_obj, i), *t = (PyObject *)Py_TYPE(op);
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL) goto done;
        int r = 0;
        if (t == pt && PyTuple_GET_SIZE(op) == 2 && PyLong_CheckExact(PyTuple_GET_ITEM(op, 0))) {
            PyObject *rk = PyTuple_GET_ITEM(op, 0);
            int folds = 0;
            PyObject *prev = i ? PyList_GET_ITEM(ops_obj, i - 1) : NULL;
            if (prev != NULL && (PyObject *)Py_TYPE(prev) == kc && PyTuple_GET_SIZE(prev) == 5) {  /* folds_probe */
                long entry, num;
                int plain = plain_pod(PyList_GET_ITEM(whose, i - 1), &num);
                int ru = plain > 0 && PyLong_CheckExact(PyTuple_GET_ITEM(prev, 0)) ? key_runs(prev, &entry) : -1;
                if (plain < 0) r = -1;
                else if (ru < 0) unusual = 1;
                else folds = ru && entry < 0 && PyObject_RichCompareBool(PyTuple_GET_ITEM(prev, 0), rk, Py_EQ) > 0;
            }
            if (r == 0 && !unusual) {
                if (folds) {
                    PyObject *at = PyLong_FromSsize_t(PyList_GET_SIZE(owners));
                    r = at == NULL ? -1 : PyDict_SetItem(folded, at, index);
                    Py_XDECREF(at);
                } else if (PyList_Append(out, q_name) < 0 || PyList_Append(out, rk) < 0
                           || PyList_Append(out, PyTuple_GET_ITEM(op, 1)) < 0 || PyList_Append(owners, index) < 0) {
                    r = -1;
                }
            }
        } else if (t == kc && PyTuple_GET_SIZE(op) == 5) {
            PyObject *rk = PyTuple_GET_ITEM(op, 0), *fld = PyTuple_GET_ITEM(op, 1), *bit = PyTuple_GET_ITEM(op, 3);
            long entry, num;
            int plain = plain_pod(PyList_GET_ITEM(whose, i), &num);
            int ru = plain > 0 ? key_runs(op, &entry) : 0;
            PyObject *pk = ru > 0 && PyUnicode_CheckExact(fld) && PyUnicode_CheckExact(bit)
                ? key_name(rk, prefix, np, suffix, ns) : NULL;
            if (pk == NULL) {
                if (plain < 0 || PyErr_Occurred()) r = -1;
                else unusual = 1;
            } else {
                char name = entry > 0 ? 's' : 'r';
                int same = reg_field != NULL && reg_num == num;
                if (same > 0) same = PyObject_RichCompareBool(reg_field, fld, Py_EQ);
                if (same > 0) same = PyObject_RichCompareBool(reg_bit, bit, Py_EQ);
                if (same < 0) {
                    r = -1;
                } else if (!same) {
                    reg_field = fld; reg_bit = bit; reg_num = num;
                    PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(whose, i), 0);
                    PyObject *own = PyDict_GetItemWithError(owns, key);
                    if (own != NULL) {
                        Py_INCREF(own);
                    } else if (!PyErr_Occurred()) {
                        own = PyObject_CallOneArg(mine, key);
                        if (own != NULL && PyDict_SetItem(owns, key, own) < 0) Py_CLEAR(own);
                    }
                    if (own == NULL || PyList_Append(out, f_name) < 0 || PyList_Append(out, fld) < 0
                        || PyList_Append(out, bit) < 0 || PyList_Append(out, own) < 0
                        || PyList_Append(owners, index) < 0)
                        r = -1;
                    Py_XDECREF(own);
                } else if (run_at >= 0 && run_name == name && run_at + 1 + 2 * run_len == PyList_GET_SIZE(out)) {
                    /* the block joins the run just before it */
                    run_len += 1;
                    PyObject *count = PyLong_FromSsize_t(run_len);
                    if (count == NULL || PyList_SetItem(out, run_at, count) < 0 || PyList_Append(out, rk) < 0
                        || PyList_Append(out, pk) < 0 || PyList_Append(owners, index) < 0)
                        r = -1;
                    Py_DECREF(pk);
                    Py_DECREF(index);
                    if (r < 0) goto done;
                    continue;
                }
                if (r == 0) {
                    run_at = PyList_GET_SIZE(out) + 1;
                    run_len = 1;
                    run_name = name;
                    if (PyList_Append(out, name == 's' ? s_name : r_name) < 0
                        || append_new(out, PyLong_FromLong(1)) < 0 || PyList_Append(out, rk) < 0
                        || PyList_Append(out, pk) < 0 || PyList_Append(owners, index) < 0)
                        r = -1;
                }
                Py_DECREF(pk);
            }
        } else {
            unusual = 1;
        }
        Py_DECREF(index);
        if (r < 0) goto done;
    }
    if (unusual) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyTuple_Pack(3, out, owners, folded);
    }
done:
    Py_XDECREF(out); Py_XDECREF(owners); Py_XDECREF(folded); Py_XDECREF(owns);
    Py_XDECREF(s_name); Py_XDECREF(r_name); Py_XDECREF(f_name); Py_XDECREF(q_name);
    return result;
}

/* ---- a plan's changes as changes.lua's arguments on a single node (changes.py change_args) */

/* Whether every change of the three types has its fields (one made by tuple.__new__ may not): the loops below
 * read them by position. */
static int changes_whole(PyObject *const *items, Py_ssize_t n, PyObject *kc, PyObject *ea, PyObject *ed) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = (PyObject *)Py_TYPE(items[i]);
        Py_ssize_t size = (t == kc || t == ea || t == ed) ? PyTuple_GET_SIZE(items[i]) : -1;
        if ((t == kc && size != 5) || ((t == ea || t == ed) && size != 2)) return 0;
    }
    return 1;
}

/* change_args(changes, own, types, key_prefix, key_suffix, engine_prefix) -> list | None: changes.py
 * change_args (its reference, see there) for the changes a batch mostly makes: entries and their bits that
 * come or go together (S and R runs under F, each block with its engine key's ZADD or ZREM beside when the
 * plan has it next to it) and engine keys' adds and drops. None, with nothing else done, for anything else
 * (a change in the general form, another type, a key outside uint64): Python then builds them all.
 * ``types``: KeyChange, EngineAdd, EngineDrop; ``own``: changes.py mine(num). */
static PyObject *change_args(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *changes, *own, *types;
    const char *prefix, *suffix, *eprefix;
    Py_ssize_t np, ns, nep;
    if (!PyArg_ParseTuple(args, "O!OO!s#s#s#", &PyList_Type, &changes, &own, &PyTuple_Type, &types, &prefix, &np,
                          &suffix, &ns, &eprefix, &nep))
        return NULL;
    if (PyTuple_GET_SIZE(types) != 3) {
        PyErr_SetString(PyExc_TypeError, "types must be (KeyChange, EngineAdd, EngineDrop)");
        return NULL;
    }
    PyTypeObject *kc = (PyTypeObject *)PyTuple_GET_ITEM(types, 0), *ea = (PyTypeObject *)PyTuple_GET_ITEM(types, 1),
                 *ed = (PyTypeObject *)PyTuple_GET_ITEM(types, 2);
    /* a tuple of the changes: a comparison below may run Python code (an __eq__), which must not free the
     * changes read (or the F register's field and bit, borrowed from one) by changing the list */
    PyObject *seq = PyList_AsTuple(changes);
    PyObject *out = PyList_New(0), *empty = PyUnicode_FromString(""), *names[6] = {NULL};
    const char *letters = "SRFzZx";
    int ok = seq != NULL && out != NULL && empty != NULL;
    for (int j = 0; j < 6 && ok; j++) ok = (names[j] = PyUnicode_FromStringAndSize(letters + j, 1)) != NULL;
    PyObject *result = NULL;
    if (!ok) goto done;
    PyObject *x_big = NULL;  /* "X" */
    if ((x_big = PyUnicode_FromString("X")) == NULL) goto done;
    PyObject *reg_field = NULL, *reg_bit = NULL;
    Py_ssize_t run_at = -1, run_len = 0, count = PyTuple_GET_SIZE(seq), i = 0;
    char run_name = 0;
    int unusual = !changes_whole(PySequence_Fast_ITEMS(seq), count, (PyObject *)kc, (PyObject *)ea, (PyObject *)ed);
    int failed = 0;
    while (i < count && !unusual && !failed) {
        PyObject *c = PyTuple_GET_ITEM(seq, i);
        PyObject *nxt = i + 1 < count ? PyTuple_GET_ITEM(seq, i + 1) : NULL;
        PyTypeObject *t = Py_TYPE(c);
        PyObject *key = NULL, *ek_name = NULL;  /* the KeyChange of a run's block, its engine key's name */
        if (t == ea && PyTuple_Check(PyTuple_GET_ITEM(c, 1)) && PyTuple_GET_SIZE(PyTuple_GET_ITEM(c, 1)) == 1
            && nxt != NULL && Py_TYPE(nxt) == kc) {
            PyObject *rks = PyTuple_GET_ITEM(c, 1);
            long e;
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(nxt, 0), PyTuple_GET_ITEM(rks, 0), Py_EQ);
            int ru = same > 0 ? key_runs(nxt, &e) : 0;
            if (same < 0) { failed = 1; break; }
            if (ru < 0) { unusual = 1; break; }
            if (same && ru && e > 0) {
                key = nxt;
                if ((ek_name = key_name(PyTuple_GET_ITEM(c, 0), eprefix, nep, "", 0)) == NULL) {
                    failed = PyErr_Occurred() != NULL; unusual = !failed; break;
                }
                i += 2;
            }
        }
        if (key == NULL && t == kc) {
            long e;
            int ru = key_runs(c, &e);
            if (ru <= 0) { unusual = 1; break; }  /* the general form (or not ints): Python's */
            key = c;
            i += 1;
            if (e < 0 && nxt != NULL && Py_TYPE(nxt) == ed && PyTuple_Check(PyTuple_GET_ITEM(nxt, 1))
                && PyTuple_GET_SIZE(PyTuple_GET_ITEM(nxt, 1)) == 1) {
                int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(PyTuple_GET_ITEM(nxt, 1), 0),
                                                    PyTuple_GET_ITEM(c, 0), Py_EQ);
                if (same < 0) { failed = 1; break; }
                if (same) {
                    if ((ek_name = key_name(PyTuple_GET_ITEM(nxt, 0), eprefix, nep, "", 0)) == NULL) {
                        failed = PyErr_Occurred() != NULL; unusual = !failed; break;
                    }
                    i += 1;
                }
            }
        }
        if (key == NULL) {  /* an engine key's add or drop on its own: z/Z, x/X */
            if (t != ea && t != ed) { unusual = 1; break; }
            PyObject *rks = PyTuple_GET_ITEM(c, 1);
            if (!PyTuple_Check(rks)) { unusual = 1; break; }
            Py_ssize_t m = PyTuple_GET_SIZE(rks);
            PyObject *name = key_name(PyTuple_GET_ITEM(c, 0), eprefix, nep, "", 0);
            if (name == NULL) { failed = PyErr_Occurred() != NULL; unusual = !failed; break; }
            int r = PyList_Append(out, m == 1 ? names[t == ea ? 3 : 5] : (t == ea ? names[4] : x_big));
            if (r == 0) r = PyList_Append(out, name);
            if (r == 0 && m != 1) r = append_new(out, PyLong_FromSsize_t(m));
            for (Py_ssize_t j = 0; j < m && r == 0; j++) r = PyList_Append(out, PyTuple_GET_ITEM(rks, j));
            Py_DECREF(name);
            failed = r < 0;
            i += 1;
            continue;
        }
        /* a block of an S or R run */
        PyObject *rk = PyTuple_GET_ITEM(key, 0), *fld = PyTuple_GET_ITEM(key, 1), *bit = PyTuple_GET_ITEM(key, 3);
        long e;
        key_runs(key, &e);
        char name = e > 0 ? 'S' : 'R';
        PyObject *pk = key_name(rk, prefix, np, suffix, ns);
        if (pk == NULL) {
            Py_XDECREF(ek_name);
            failed = PyErr_Occurred() != NULL; unusual = !failed; break;
        }
        if (ek_name == NULL) ek_name = Py_NewRef(empty);
        int same = reg_field != NULL;
        if (same) same = PyObject_RichCompareBool(reg_field, fld, Py_EQ);
        if (same > 0) same = PyObject_RichCompareBool(reg_bit, bit, Py_EQ);
        int r = same < 0 ? -1 : 0;
        if (r == 0 && !same) {
            reg_field = fld;
            reg_bit = bit;
            if (PyList_Append(out, names[2]) < 0 || PyList_Append(out, fld) < 0 || PyList_Append(out, bit) < 0
                || PyList_Append(out, own) < 0)
                r = -1;
        } else if (r == 0 && run_at >= 0 && run_name == name && run_at + 1 + 3 * run_len == PyList_GET_SIZE(out)) {
            run_len += 1;  /* the block joins the run just before it */
            PyObject *n = PyLong_FromSsize_t(run_len);
            if (n == NULL || PyList_SetItem(out, run_at, n) < 0 || PyList_Append(out, rk) < 0
                || PyList_Append(out, pk) < 0 || PyList_Append(out, ek_name) < 0)
                r = -1;
            Py_DECREF(pk);
            Py_DECREF(ek_name);
            failed = r < 0;
            continue;
        }
        if (r == 0) {
            run_at = PyList_GET_SIZE(out) + 1;
            run_len = 1;
            run_name = name;
            if (PyList_Append(out, names[name == 'S' ? 0 : 1]) < 0 || append_new(out, PyLong_FromLong(1)) < 0
                || PyList_Append(out, rk) < 0 || PyList_Append(out, pk) < 0 || PyList_Append(out, ek_name) < 0)
                r = -1;
        }
        Py_DECREF(pk);
        Py_DECREF(ek_name);
        failed = r < 0;
    }
    if (!failed) result = unusual ? Py_NewRef(Py_None) : Py_NewRef(out);
    Py_DECREF(x_big);
done:
    Py_XDECREF(seq);
    Py_XDECREF(out);
    Py_XDECREF(empty);
    for (int j = 0; j < 6; j++) Py_XDECREF(names[j]);
    return result;
}

/* ---- a Valkey Cluster run's rounds (kv_preflight/index/cluster/outbox_ops.py, run by writes.py), read off the
 * outbox entries' changes */

/* ``types`` as the run's routines get them: (KeyChange, EngineAdd, EngineDrop, Probe), Probe a NamedTuple (a tuple
 * subclass of no fields of its own, so that ``pair`` may make one); 0 with a TypeError for anything else */
static int run_types(PyObject *types, PyObject **kc, PyObject **ea, PyObject **ed, PyTypeObject **pt) {
    PyTypeObject *p = PyTuple_GET_SIZE(types) == 4 && PyType_Check(PyTuple_GET_ITEM(types, 3))
        ? (PyTypeObject *)PyTuple_GET_ITEM(types, 3) : NULL;
    if (p == NULL || !PyType_IsSubtype(p, &PyTuple_Type) || p->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "types must be (KeyChange, EngineAdd, EngineDrop, Probe)");
        return 0;
    }
    *kc = PyTuple_GET_ITEM(types, 0); *ea = PyTuple_GET_ITEM(types, 1); *ed = PyTuple_GET_ITEM(types, 2); *pt = p;
    return 1;
}

/* A ``t`` (a NamedTuple of two fields) of a and b, as tuple.__new__(t, (a, b)) makes it */
static PyObject *pair(PyTypeObject *t, PyObject *a, PyObject *b) {
    PyObject *p = t->tp_alloc(t, 2);
    if (p == NULL) return NULL;
    PyTuple_SET_ITEM(p, 0, Py_NewRef(a));
    PyTuple_SET_ITEM(p, 1, Py_NewRef(b));
    return p;
}

/* d[k] = j */
static int append_at(PyObject *d, PyObject *k, Py_ssize_t j) {
    PyObject *at = PyLong_FromSsize_t(j);
    if (at == NULL) return -1;
    int r = PyDict_SetItem(d, k, at);
    Py_DECREF(at);
    return r;
}

/* set(rks) in its iteration order (what Python's ``for rk in set(rks)`` meets) */
static PyObject *distinct(PyObject *rks) {
    PyObject *set = PySet_New(rks);
    if (set == NULL) return NULL;
    PyObject *out = PySequence_List(set);
    Py_DECREF(set);
    return out;
}

/* An engine key's add or drop whose request keys are a tuple of at least one (a plan's and a decoded entry's) */
static int engine_change(PyObject *c) {
    PyObject *rks = PyTuple_GET_SIZE(c) == 2 ? PyTuple_GET_ITEM(c, 1) : NULL;
    return rks != NULL && PyTuple_Check(rks) && PyTuple_GET_SIZE(rks) > 0;
}

/* run_keys(entries, types) -> (key_ops, whose, request_keys) | None: outbox_ops.py _run_keys (the reference): over
 * the entries' changes in order, the KeyChanges as they are and a Probe(rk, j) per distinct request key of each
 * engine key's drop, per such op its entry, and the KeyChanges' request keys. None for an entry or change of
 * another shape (Python then takes the run). */
static PyObject *run_keys(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *entries, *types, *kc, *ea, *ed;
    PyTypeObject *pt;
    if (!PyArg_ParseTuple(args, "OO!", &entries, &PyTuple_Type, &types) || !run_types(types, &kc, &ea, &ed, &pt))
        return NULL;
    if (!PyList_Check(entries)) Py_RETURN_NONE;
    PyObject *key_ops = PyList_New(0), *whose = PyList_New(0), *rks_out = PyList_New(0), *result = NULL;
    if (!key_ops || !whose || !rks_out) goto done;
    Py_ssize_t j = 0;
    for (Py_ssize_t e = 0; e < PyList_GET_SIZE(entries); e++) {
        PyObject *entry = PyList_GET_ITEM(entries, e);
        PyObject *changes = PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) >= 3 ? PyTuple_GET_ITEM(entry, 2) : NULL;
        if (changes == NULL || !PyList_Check(changes)
            || !changes_whole(PySequence_Fast_ITEMS(changes), PyList_GET_SIZE(changes), kc, ea, ed)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        /* held, and sizes read afresh: a request key's hash (a set of a drop's keys) may run Python code */
        Py_INCREF(entry);
        Py_INCREF(changes);
        int r = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(changes) && r == 0; i++, j++) {
            PyObject *c = PyList_GET_ITEM(changes, i), *t = (PyObject *)Py_TYPE(c);
            if (t == kc) {
                r = PyList_Append(key_ops, c) < 0 || PyList_Append(whose, entry) < 0
                    || PyList_Append(rks_out, PyTuple_GET_ITEM(c, 0)) < 0 ? -1 : 0;
            } else if (t == ed && engine_change(c)) {
                PyObject *rks = PyTuple_GET_ITEM(c, 1), *at = PyLong_FromSsize_t(j);
                PyObject *each = at == NULL ? NULL : PyTuple_GET_SIZE(rks) == 1 ? PySequence_List(rks) : distinct(rks);
                if (each == NULL) {
                    r = at == NULL ? -1 : 1;  /* an unhashable key: Python's */
                    PyErr_Clear();
                }
                for (Py_ssize_t k = 0; each != NULL && k < PyList_GET_SIZE(each) && r == 0; k++)
                    r = append_new(key_ops, pair(pt, PyList_GET_ITEM(each, k), at)) < 0
                        || PyList_Append(whose, entry) < 0 ? -1 : 0;
                Py_XDECREF(each);
                Py_XDECREF(at);
            } else if (t != ea || !engine_change(c)) {
                r = 1;  /* another type or shape: Python's */
            }
        }
        Py_DECREF(entry);
        Py_DECREF(changes);
        if (r < 0) goto done;
        if (r > 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    result = PyTuple_Pack(3, key_ops, whose, rks_out);
done:
    Py_XDECREF(key_ops); Py_XDECREF(whose); Py_XDECREF(rks_out);
    return result;
}

/* engine_round(changes, empty_at, prefix, types) -> (commands, engine_keys, drops) | None: outbox_ops.py
 * _engine_round (the reference): round B in the run's order, an engine key's ZADD per add (its request keys at
 * their positions), its ZREM per drop whose every distinct request key ``empty_at`` counts empty, the engine keys
 * commanded and the drops as (j, drop). None for a change of another shape or an engine key outside uint64
 * (Python then does it). */
static PyObject *engine_round(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *changes, *empty_at, *types, *kc, *ea, *ed;
    PyTypeObject *pt;
    const char *prefix;
    Py_ssize_t np;
    if (!PyArg_ParseTuple(args, "OOs#O!", &changes, &empty_at, &prefix, &np, &PyTuple_Type, &types)
        || !run_types(types, &kc, &ea, &ed, &pt))
        return NULL;
    if (!PyList_Check(changes) || !PyDict_Check(empty_at)
        || !changes_whole(PySequence_Fast_ITEMS(changes), PyList_GET_SIZE(changes), kc, ea, ed))
        Py_RETURN_NONE;
    PyObject *cmds = PyList_New(0), *eks = PyList_New(0), *drops = PyList_New(0);
    PyObject *zadd = PyUnicode_FromString("ZADD"), *zrem = PyUnicode_FromString("ZREM");
    PyObject *result = NULL;
    if (!cmds || !eks || !drops || !zadd || !zrem) goto done;
    Py_ssize_t n = PyList_GET_SIZE(changes);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *c = PyList_GET_ITEM(changes, j), *t = (PyObject *)Py_TYPE(c);
        if (t == kc) continue;
        if ((t != ea && t != ed) || !engine_change(c)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *ek = PyTuple_GET_ITEM(c, 0), *rks = PyTuple_GET_ITEM(c, 1);
        Py_ssize_t m = PyTuple_GET_SIZE(rks);
        PyObject *cmd = NULL;
        if (t == ed) {
            Py_ssize_t want = 1;
            if (m != 1) {
                PyObject *set = PySet_New(rks);
                if (set == NULL) goto done;
                want = PySet_GET_SIZE(set);
                Py_DECREF(set);
            }
            PyObject *at = PyLong_FromSsize_t(j);
            if (at == NULL) goto done;
            long long empty;
            int r = dget(empty_at, at, &empty);
            if (r == 0 && empty == want) r = append_new(drops, PyTuple_Pack(2, at, c));
            Py_DECREF(at);
            if (r < 0) goto done;
            if (empty != want) continue;
        }
        PyObject *name = key_name(ek, prefix, np, "", 0);
        if (name == NULL) {
            if (PyErr_Occurred()) goto done;
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (t == ea) {  /* ("ZADD", name, 0, rk0, 1, rk1, ...) */
            if ((cmd = PyTuple_New(2 + 2 * m)) != NULL) {
                PyTuple_SET_ITEM(cmd, 0, Py_NewRef(zadd));
                PyTuple_SET_ITEM(cmd, 1, name);
                for (Py_ssize_t i = 0; i < m && cmd != NULL; i++) {
                    PyObject *pos = PyLong_FromSsize_t(i);
                    if (pos == NULL) { Py_CLEAR(cmd); break; }
                    PyTuple_SET_ITEM(cmd, 2 + 2 * i, pos);
                    PyTuple_SET_ITEM(cmd, 3 + 2 * i, Py_NewRef(PyTuple_GET_ITEM(rks, i)));
                }
            } else {
                Py_DECREF(name);
            }
        } else {  /* ("ZREM", name, *rks) */
            if ((cmd = PyTuple_New(2 + m)) != NULL) {
                PyTuple_SET_ITEM(cmd, 0, Py_NewRef(zrem));
                PyTuple_SET_ITEM(cmd, 1, name);
                for (Py_ssize_t i = 0; i < m; i++) PyTuple_SET_ITEM(cmd, 2 + i, Py_NewRef(PyTuple_GET_ITEM(rks, i)));
            } else {
                Py_DECREF(name);
            }
        }
        if (append_new(cmds, cmd) < 0 || PyList_Append(eks, ek) < 0) goto done;
    }
    result = PyTuple_Pack(3, cmds, eks, drops);
done:
    Py_XDECREF(cmds); Py_XDECREF(eks); Py_XDECREF(drops); Py_XDECREF(zadd); Py_XDECREF(zrem);
    return result;
}

/* raced(changes, drops, back, types) -> list | None: outbox_ops.py _raced (the reference): round D, the drops
 * (j, drop) one of whose request keys is in ``back`` (a set: it holds an entry again after round B) and is not
 * stored by a KeyChange of the run after the drop (such a store explains the entry; any other is a writer that
 * raced the drop's ZREM). None for a change or drop of another shape (Python then does it). */
static PyObject *raced(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *changes, *drops, *back, *types, *kc, *ea, *ed;
    PyTypeObject *pt;
    if (!PyArg_ParseTuple(args, "OOOO!", &changes, &drops, &back, &PyTuple_Type, &types)
        || !run_types(types, &kc, &ea, &ed, &pt))
        return NULL;
    if (!PyList_Check(changes) || !PyList_Check(drops)
        || !changes_whole(PySequence_Fast_ITEMS(changes), PyList_GET_SIZE(changes), kc, ea, ed))
        Py_RETURN_NONE;
    if (!PyAnySet_Check(back)) {
        PyErr_SetString(PyExc_TypeError, "back must be a set");
        return NULL;
    }
    PyObject *stored_at = PyDict_New(), *zero = PyLong_FromLong(0), *out = PyList_New(0), *result = NULL;
    if (stored_at == NULL || zero == NULL || out == NULL) goto done;
    /* per key of ``back``, the run's last KeyChange storing it; the list's size read afresh and the change held:
     * a key's hash or comparison may run Python code */
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(changes); j++) {
        PyObject *c = PyList_GET_ITEM(changes, j);
        if ((PyObject *)Py_TYPE(c) != kc) continue;
        Py_INCREF(c);
        PyObject *rk = PyTuple_GET_ITEM(c, 0);
        int in = PySet_Contains(back, rk);
        int stores = in > 0 ? PyObject_RichCompareBool(PyTuple_GET_ITEM(c, 2), zero, Py_GT) : 0;
        int r = in < 0 || stores < 0 || (stores && append_at(stored_at, rk, j) < 0) ? -1 : 0;
        Py_DECREF(c);
        if (r < 0) goto done;
    }
    /* the drops: each held while its keys are looked up (a key's hash may run Python code) */
    for (Py_ssize_t d = 0; d < PyList_GET_SIZE(drops); d++) {
        PyObject *drop = PyList_GET_ITEM(drops, d);
        PyObject *c = PyTuple_Check(drop) && PyTuple_GET_SIZE(drop) == 2 ? PyTuple_GET_ITEM(drop, 1) : NULL;
        if (c == NULL || !PyLong_CheckExact(PyTuple_GET_ITEM(drop, 0)) || (PyObject *)Py_TYPE(c) != ed
            || !engine_change(c)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        long long j = PyLong_AsLongLong(PyTuple_GET_ITEM(drop, 0));
        if (j == -1 && PyErr_Occurred()) goto done;
        PyObject *rks = Py_NewRef(PyTuple_GET_ITEM(c, 1));
        Py_INCREF(drop);
        int r = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rks) && r == 0; i++) {
            PyObject *rk = PyTuple_GET_ITEM(rks, i);
            int in = PySet_Contains(back, rk);
            PyObject *got = in > 0 ? PyDict_GetItemWithError(stored_at, rk) : NULL;
            if (in < 0 || (got == NULL && PyErr_Occurred())) r = -1;
            else if (in && (got == NULL ? -1 : PyLong_AsLongLong(got)) < j) r = PyList_Append(out, drop) < 0 ? -1 : 1;
        }
        Py_DECREF(rks);
        Py_DECREF(drop);
        if (r < 0) goto done;
    }
    result = Py_NewRef(out);
done:
    Py_XDECREF(stored_at); Py_XDECREF(zero); Py_XDECREF(out);
    return result;
}

static PyMethodDef methods[] = {
    {"plan_blocks", plan_blocks, METH_VARARGS,
     "PodState.plan's loop over stores and removals: plan_blocks(state, out, mutations, start, reannouncements, "
     "types) -> the index of the first mutation left to Python."},
    {"change_args", change_args, METH_VARARGS,
     "changes.py change_args for S/R runs and engine keys' adds and drops: the arguments, or None for Python."},
    {"run_keys", run_keys, METH_VARARGS, "outbox_ops.py _run_keys: (key_ops, whose, request_keys), or None."},
    {"engine_round", engine_round, METH_VARARGS,
     "outbox_ops.py _engine_round: (commands, engine_keys, drops), or None."},
    {"raced", raced, METH_VARARGS, "outbox_ops.py _raced: the drops a store of another writer raced, or None."},
    {"shard_args", shard_args, METH_VARARGS,
     "changes.py shard_args for s/r runs and probes: (args, owners, folded), or None for Python to do it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_write_path", NULL, -1, methods};

PyMODINIT_FUNC PyInit__write_path(void) {
    static const char *names[] = {"blocks", "tiers", "entry_refs", "bit_refs", "ek_slots", "ek_refs", "rk_links",
        "deferred", "waiting", "held", "known", "kids", "parent_of", "_bits", "_prefix", "unknown", "orphans",
        "engine_key", "tier", "entry_field", "request_keys", "group", "parentless", "parent", "field", "rks",
        "copies", "changes", "stored", "removed", "bit_of", "_undefer", "_defer", "_release"};
    PyObject **slots[] = {&s_blocks, &s_tiers, &s_entry_refs, &s_bit_refs, &s_ek_slots, &s_ek_refs, &s_rk_links,
        &s_deferred, &s_waiting, &s_held, &s_known, &s_kids, &s_parent_of, &s_bits_cache, &s_prefix, &s_unknown,
        &s_orphans, &s_engine_key, &s_tier, &s_entry_field, &s_request_keys, &s_group, &s_parentless, &s_parent,
        &s_field, &s_rks, &s_copies, &s_changes, &s_stored, &s_removed, &s_bit_of, &s_undefer, &s_defer,
        &s_release};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    }
    return PyModule_Create(&module);
}
