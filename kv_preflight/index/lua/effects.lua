-- (after changes.lua) Valkey Cluster, step 2 of a batch: one shard's share of a batch's changes, in one call,
-- sent with no declared keys to the node that owns their keys. Every change touches one slot and is
-- idempotent; each command runs alone (pcall), so one that fails changes nothing else. A key that moved away
-- (resharding, failover) fails with "non local key": its op is listed for the caller to send through the
-- cluster's routing. ARGV: the changes (changes.lua), flat, in order.
-- Returns {moved op positions "i,j,..", foreign-typed writes, the first such error, the q ops' j that found
-- their request key empty, the positions of the r blocks that left their key empty}.
run_changes(1)
local seen, uniq = {}, {}
for _, p in ipairs(moved) do
  if not seen[p] then seen[p] = true; uniq[#uniq + 1] = p end
end
return {table.concat(uniq, ','), foreign.n, foreign.first or '', probes, emptied}
