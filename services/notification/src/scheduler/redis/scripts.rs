//! The Lua scripts of the Redis scheduler and the sizes they work with; the module above says
//! how the keys fit together.

/// Due time covered by one waiting segment: a second. Finer means more keys and more parts per
/// claim; coarser, that the segment of the current second (copied, not renamed, because only
/// part of it is due) is larger.
pub(super) const SEGMENT_US: i64 = 1_000_000;

/// Most parts in one claim: bounds what an acknowledgement looks through.
pub(super) const PARTS: usize = 24;

/// Parts read in the claim's own round trip (one `ZRANGE` each, an absent part empty); a claim
/// with more has the rest read in a second. A claim of a few due members, what a delivery loop
/// keeping up makes over and over, has one part: reading all [`PARTS`] every time cost
/// `notification-delivery` about 0.2 ms of p50.
pub(super) const PARTS_READ_AT_ONCE: usize = 4;

/// Segments with fewer members are copied into the claim rather than renamed into a part of
/// their own, so a sparse schedule does not spend the claim's parts on one or two members each.
pub(super) const SMALL: usize = 32;

/// Segments of one second hold at most about this many members before the second is *crowded*:
/// later adds for it spread over more segments (see [`ADD_SCRIPT`]), so that a second every
/// notification of a campaign shares is still claimed by renaming, not member by member.
pub(super) const CROWDED: usize = 1024;

/// Segments a crowded second's first extra level has; each further level has four times more.
pub(super) const FAN_OUT: usize = 16;

/// Adds each member of ARGV to a segment of its second of due time, lists a new segment in the
/// waiting index (KEYS[1]) or lowers its score, and counts what it added (KEYS[4]). KEYS[2] = the
/// live parts, KEYS[3] = the returned segments, KEYS[5] = the crowded seconds (second → levels).
/// ARGV[1] = the segment key prefix, ARGV[2] = 1 to skip ids that are waiting or claimed, ARGV[3]
/// = the width of a second in µs, ARGV[4] = [`CROWDED`], ARGV[5] = [`FAN_OUT`], then pairs: due
/// time, id. Returns how many it added.
///
/// A second's members go to its segment `<second>` until that holds [`CROWDED`]; the second then
/// has a level 1 of [`FAN_OUT`] segments `<second>:1:<h>`, `h` from a hash of the id, until one
/// of those fills, then a level 2 four times wider, and so on (`HINCRBY` of the second's field in
/// KEYS[5]; a field is left behind once the second is delivered, a few bytes per crowded second).
/// So an id is found again by looking at one segment per level of its second: the check looks
/// there (due times do not change), then in every live part and returned segment for the ids not
/// found, one `ZMSCORE` each. One script, so a claim cannot move a member between the check and
/// the add, and two replicas restoring the same entries add each once.
pub(super) const ADD_SCRIPT: &str = r"
local W, L, R, C, X = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local seg_prefix, check = ARGV[1], ARGV[2] == '1'
local width, crowded, fan = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local levels = {}
local function second(due)
  return string.format('%.0f', math.floor(tonumber(due) / width))
end
local function levels_of(sec)
  if levels[sec] == nil then
    levels[sec] = tonumber(redis.call('HGET', X, sec) or '0')
  end
  return levels[sec]
end
local function segment(sec, level, id)
  if level == 0 then return seg_prefix .. sec end
  local h = tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % (fan * 4 ^ (level - 1))
  return seg_prefix .. sec .. ':' .. level .. ':' .. string.format('%.0f', h)
end
local function waiting(sec, id)
  for level = 0, levels_of(sec) do
    if redis.call('ZSCORE', segment(sec, level, id), id) then return true end
  end
  return false
end
local todo = {}
for i = 6, #ARGV, 2 do
  if not (check and waiting(second(ARGV[i]), ARGV[i + 1])) then
    todo[#todo + 1] = i
  end
end
if check and #todo > 0 then
  local held = {}
  for _, list in ipairs({L, R}) do
    for _, seg in ipairs(redis.call('ZRANGE', list, 0, -1)) do
      local ids = {}
      for _, i in ipairs(todo) do
        if not held[i] then ids[#ids + 1] = ARGV[i + 1] end
      end
      if #ids == 0 then break end
      local scores = redis.call('ZMSCORE', seg, unpack(ids))
      local k = 0
      for _, i in ipairs(todo) do
        if not held[i] then
          k = k + 1
          if scores[k] then held[i] = true end
        end
      end
    end
  end
  local left = {}
  for _, i in ipairs(todo) do
    if not held[i] then left[#left + 1] = i end
  end
  todo = left
end
local added = 0
for _, i in ipairs(todo) do
  local due, id = ARGV[i], ARGV[i + 1]
  local sec = second(due)
  local level = levels_of(sec)
  local seg = segment(sec, level, id)
  if redis.call('ZADD', seg, 'NX', due, id) == 1 then
    added = added + 1
    redis.call('ZADD', W, 'LT', due, seg)
    if redis.call('ZCARD', seg) >= crowded then
      levels[sec] = redis.call('HINCRBY', X, sec, 1)
    end
  end
end
if added > 0 then
  redis.call('INCRBY', C, added)
end
return added
";

/// Claims up to ARGV[2] members due at ARGV[1] under the lease deadline ARGV[3], into parts named
/// ARGV[4] followed by 0, 1, … (at most ARGV[5] of them); segments with fewer than ARGV[6]
/// members are copied rather than renamed. First, parts whose lease ran out (KEYS[2]) go back
/// to the waiting index (KEYS[1]) and the returned segments (KEYS[3]). Returns how many parts the
/// claim has; the caller reads them in the same round trip.
///
/// A segment whose members are all due and that fits is renamed into a part: no member is
/// touched. Otherwise its due members are copied: into a new part by `ZRANGESTORE` (one command)
/// when the claim has no copy part yet, through this script into the copy part after that, then
/// removed from the segment by rank (`ZREMRANGEBYRANK 0 n-1`: a range from `-inf` is the lowest
/// ranks, and the script runs atomically). A segment left with members is scored by its new
/// earliest one, so the index always says when something is next due.
pub(super) const CLAIM_SCRIPT: &str = r"
local W, L, R = KEYS[1], KEYS[2], KEYS[3]
local now_arg, left, deadline, part_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local now, parts_max, small = tonumber(now_arg), tonumber(ARGV[5]), tonumber(ARGV[6])
local slice, page_size = 500, 32

for _, seg in ipairs(redis.call('ZRANGE', L, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, 4 * parts_max)) do
  redis.call('ZREM', L, seg)
  local first = redis.call('ZRANGE', seg, 0, 0, 'WITHSCORES')
  if first[1] then
    redis.call('ZADD', W, first[2], seg)
    redis.call('ZADD', R, 0, seg)
  end
end

local parts, copy = 0, nil
local function new_part()
  local key = part_prefix .. parts
  parts = parts + 1
  redis.call('ZADD', L, deadline, key)
  return key
end
local function forget(seg)
  redis.call('ZREM', W, seg)
  redis.call('ZREM', R, seg)
end

-- A page of segments at a time: the claim usually ends within the first few, and each one
-- fetched is a string into Lua. Every segment looked at leaves the due range (renamed, emptied,
-- or scored by a member not yet due) unless the claim is full, so the next page starts at 0.
-- The page count is capped all the same: a script that never ends would stop Redis.
local done, pages = false, 0
while left > 0 and not done and pages < 1000 do
  pages = pages + 1
  local page = redis.call('ZRANGE', W, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, page_size)
  done = #page < page_size
  for _, seg in ipairs(page) do
    if left <= 0 then break end
    local n = redis.call('ZCARD', seg)
    local whole = n >= small and n <= left and parts < parts_max - 1
      and tonumber(redis.call('ZRANGE', seg, -1, -1, 'WITHSCORES')[2]) <= now
    if n == 0 then
      forget(seg)
    elseif whole then
      redis.call('RENAME', seg, new_part())
      forget(seg)
      left = left - n
    elseif copy == nil and parts < parts_max then
      copy = new_part()
      local k = redis.call('ZRANGESTORE', copy, seg, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, left)
      if k > 0 then
        redis.call('ZREMRANGEBYRANK', seg, 0, k - 1)
        left = left - k
      end
    elseif copy ~= nil then
      local members = redis.call('ZRANGE', seg, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, left, 'WITHSCORES')
      local k = #members / 2
      for i = 1, #members, 2 * slice do
        local add = {}
        for j = i, math.min(i + 2 * slice - 1, #members), 2 do
          add[#add + 1] = members[j + 1]
          add[#add + 1] = members[j]
        end
        redis.call('ZADD', copy, unpack(add))
      end
      if k > 0 then
        redis.call('ZREMRANGEBYRANK', seg, 0, k - 1)
        left = left - k
      end
    else
      done = true
      break
    end
    if n > 0 and not whole then
      local first = redis.call('ZRANGE', seg, 0, 0, 'WITHSCORES')
      if first[1] then
        redis.call('ZADD', W, 'XX', first[2], seg)
      else
        forget(seg)
      end
    end
  end
end
if copy ~= nil and redis.call('EXISTS', copy) == 0 then
  redis.call('ZREM', L, copy)
end
return parts
";

/// Acknowledges the ids in ARGV: out of the live parts that hold them (KEYS[1], oldest first,
/// stopping once every id is found), then out of the returned segments (KEYS[2]: a lease that ran
/// out put them back), and out of the count (KEYS[3]). An emptied part or segment is dropped from
/// its list (and from the waiting index, KEYS[4]).
pub(super) const ACK_SCRIPT: &str = r"
local L, R, C, W = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local slice = 500
local left = #ARGV
local removed = 0
for _, list in ipairs({L, R}) do
  for _, seg in ipairs(redis.call('ZRANGE', list, 0, -1)) do
    if left <= 0 then break end
    for i = 1, #ARGV, slice do
      local n = redis.call('ZREM', seg, unpack(ARGV, i, math.min(i + slice - 1, #ARGV)))
      left = left - n
      removed = removed + n
    end
    if redis.call('EXISTS', seg) == 0 then
      redis.call('ZREM', list, seg)
      if list == R then redis.call('ZREM', W, seg) end
    end
  end
end
if removed > 0 then
  redis.call('DECRBY', C, removed)
end
return removed
";

/// Removes every segment, part and list of this scheduler, and the count (benchmarks and tools
/// cleaning up; `UNLINK`, so a million members are freed off Redis's main thread).
pub(super) const REMOVE_ALL_SCRIPT: &str = r"
for _, list in ipairs({KEYS[1], KEYS[2]}) do
  local keys = redis.call('ZRANGE', list, 0, -1)
  for i = 1, #keys, 500 do
    redis.call('UNLINK', unpack(keys, i, math.min(i + 499, #keys)))
  end
end
return redis.call('UNLINK', unpack(KEYS))
";

/// Members per add script call when many are added at once.
pub(super) const ADD_CHUNK: usize = 1000;
