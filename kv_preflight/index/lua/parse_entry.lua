-- Shared Lua: a PodEntry field -> pod, tier; nil for speculative or unparseable entries.
-- Speculative entries (written by llm-d's scheduler before the engine confirms) are
-- not cache, so they never count.
local function parse(f)
  if string.sub(f, 1, 1) == '{' then
    if string.find(f, '"Speculative":true', 1, true) then return nil end
    -- llm-d's own encoding (Go field order, no escapes): one match, the common case by far
    local pod, tier = string.match(f, '^{"PodIdentifier":"([^"\\]*)","DeviceTier":"([^"\\]*)"')
    if pod then return pod, tier end
    local pod = string.match(f, '"PodIdentifier":"(.-)"')
    if pod and string.find(pod, '\\', 1, true) then
      local ok, obj = pcall(cjson.decode, f)
      if not ok then return nil end
      return obj.PodIdentifier, obj.DeviceTier or 'gpu'
    end
    return pod, string.match(f, '"DeviceTier":"(.-)"') or 'gpu'
  end
  local pod, tier = string.match(f, '^([^@]*)@([^%[]*)')
  if not pod or pod == '' then return nil end
  if string.find(f, '[speculative]', 1, true) then return nil end
  if tier == '' then tier = 'gpu' end
  return pod, tier
end
