# Sourced by the device carry builders (build_cublas_carry.sh, build_nccl_carry.sh), which set $root (the
# repository) first: the gpu extra's pin of a library wheel, the shared prune tool, a work folder removed on
# exit, the download, and the check that the pruned library still reports the pinned version.

# carry_fetch TOOL DIST OVERRIDE: sets $version (the pin in pyproject.toml, or the variable named OVERRIDE),
# $PRUNE_FATBIN (exported) and $work, and downloads DIST==$version into $work.
carry_fetch() {
  local tool=$1 dist=$2 override=$3
  version=${!override:-$(sed -n "s/.*\"$dist==\([0-9.]*\)\".*/\1/p" "$root/pyproject.toml")}
  [ -n "$version" ] || { echo "$tool: no $dist pin in pyproject.toml" >&2; exit 2; }
  export PRUNE_FATBIN=${PRUNE_FATBIN:-$root/../shared/device/te/prune_fatbin.py}
  [ -f "$PRUNE_FATBIN" ] || { echo "$tool: $PRUNE_FATBIN not found (shared/device/te/prune_fatbin.py)" >&2; exit 2; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "$tool: downloading $dist==$version" >&2
  python3 -m pip download -q --disable-pip-version-check --no-deps -d "$work" "$dist==$version"
}

# carry_expect_version TOOL WHAT GOT: stop unless GOT (a library's MAJOR*10000+MINOR*100+PATCH) is $version's.
carry_expect_version() {
  local major minor patch
  IFS=. read -r major minor patch _ <<<"$version"
  [ "$3" = $((major * 10000 + minor * 100 + patch)) ] || { echo "$1: pruned $2 reports $3, expected $version" >&2; exit 1; }
}

# carry_split FILE DEST NAME: cut FILE into carries DEST/.NAME_0, .NAME_1, ...: a first part of 7 MB (it rides
# beside TE's archive and the wheelhouse, about 54 MiB), then parts of 63 MB, one 64 MiB carry each; the last
# folder also holds the whole file's sha256. On the device, scripts/device/carry_join.sh puts them together.
carry_split() {
  local file=$1 dest=$2 name=$3 size offset=0 i=0 len
  size=$(stat -c %s "$file")
  rm -rf "$dest/.$name"_*
  while [ "$offset" -lt "$size" ]; do
    len=$([ "$i" -eq 0 ] && echo 7000000 || echo 63000000)
    mkdir -p "$dest/.${name}_$i"
    dd if="$file" of="$dest/.${name}_$i/p$i" iflag=skip_bytes,count_bytes skip="$offset" count="$len" bs=4M status=none
    offset=$((offset + len)) i=$((i + 1))
  done
  sha256sum "$file" | cut -d' ' -f1 >"$dest/.${name}_$((i - 1))/sha"
  du -sh "$dest/.$name"_* >&2
}
