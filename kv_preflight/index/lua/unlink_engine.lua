-- Cluster effect "U": drop one pod block from an engine key's membership set; the engine key goes
-- with its last member. KEYS: kvpf:{engine:<key>}:pods, engine:<key> (one slot, by the hash tag).
-- ARGV: member ("<pod>|<tier>[|<group>]").
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[2]) end
return 1
