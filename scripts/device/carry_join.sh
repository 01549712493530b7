# Sourced in a device call: put together a library that scripts/device/carry_fetch.sh's carry_split cut into
# carries .NAME_0, .NAME_1, ... (one or a few a call, on one machine held between the calls; it is given back
# 30 s after a call). The parts wait in $CARRY_STASH/NAME (default /opt/NAME), which outlives a call.
# carry_stash NAME: keep the parts this call carried, for the call that has the last one.
# carry_join NAME OUT: stash, then write the whole file to OUT once every part has arrived and its sha256
#   (carried with the last part) matches.
carry_stash() {
  local stash=${CARRY_STASH:-/opt}/$1 p
  mkdir -p "$stash" && for p in ."$1"_*/p*; do [ -f "$p" ] && cp "$p" "$stash/"; done
  ls "$stash"
}
carry_join() {
  local name=$1 out=$2 stash=${CARRY_STASH:-/opt}/$1 last missing=() i
  carry_stash "$name" >/dev/null || return 1
  last=$(ls -d ."$name"_*/sha 2>/dev/null) ||
    { echo "carry_join: the last part of $name (with its sha) was not carried" >&2; return 1; }
  last=${last%/sha}; last=${last##*_}
  for ((i = 0; i <= last; i++)); do [ -f "$stash/p$i" ] || missing+=(".${name}_$i"); done
  [ ${#missing[@]} -eq 0 ] ||
    { echo "carry_join: $name lacks ${missing[*]}: carry each in a call before this one" >&2; return 1; }
  for ((i = 0; i <= last; i++)); do cat "$stash/p$i"; done >"$out" || return 1
  echo "$(cat ."$name"_"$last"/sha)  $out" | sha256sum -c - >&2 ||
    { echo "carry_join: $name's parts do not make the file that was cut" >&2; return 1; }
}
