-- (after seq.lua, pod_write.lua and changes.lua) Applying one batch of a pod on a single node, atomically:
-- the seq and generation checks, the batch's changes to the keys every pod shares, and the pod's own writes.
-- The writer planned the changes against the pod's state at generation ARGV[5]
-- (kv_preflight/index/pod_state.py); the script runs them only while the pod is still there, so a plan made
-- from a stale copy is refused ("stale") before anything is written.
--
-- KEYS: the pod's meta, the pod's state log. ARGV: rank, seq, ts, mode, gen, now, model, engine block size
-- ("" unknown), then pod_write.lua's, then the changes (changes.lua).
-- Answers {status, last seq, foreign writes, detail, generation now}.
local stop = check_batch()
if stop then return stop end
local a = read_pod_args()
run_changes(a.rest)
write_pod(a, foreign.n, foreign.first)
return {'applied', last_s, foreign.n, foreign.first or '', a.newgen}
