-- The exact linear walk (mode "linear"): one HKEYS per key, keeping the pods that hold every
-- key so far, early stop when none is left; each distinct field is parsed once. Same ARGV.
-- It is what the pipeline path computes in Python, and the reference the tests hold the other
-- lookups to.
local alive, counts, tiers = nil, {}, {}
for i = 1, n do
  local present = pods_in(read('HKEYS', key(i)))
  if alive == nil then
    alive = present
  else
    for pod, _ in pairs(alive) do
      if present[pod] == nil then alive[pod] = nil end
    end
  end
  local any = false
  for pod, _ in pairs(alive) do
    counts[pod] = i
    tiers[pod] = present[pod]
    any = true
  end
  if not any then break end
end
local out = {foreign}
for pod, c in pairs(counts) do
  out[#out + 1] = pod
  out[#out + 1] = c
  out[#out + 1] = tiers[pod]
end
return out
