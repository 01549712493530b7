# shellcheck shell=bash
# Sourced by scripts/build_container.sh and scripts/check_container.sh: which container engine, and what it needs here.

# container_engine prints docker when a Docker daemon answers, else podman (a docker client alone does not build).
container_engine() {
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    echo docker
  elif command -v podman >/dev/null; then
    echo podman
  else
    return 1
  fi
}

# engine_limits ENGINE prints the --ulimit arguments podman needs where this shell cannot raise its own limits
# (a machine that is itself a container): podman asks for higher RLIMIT_NOFILE and RLIMIT_NPROC than such a shell
# may set, and runc fails with "error setting rlimits ... operation not permitted". It then passes this shell's
# hard open-files limit, and 4096 processes (larger process limits were refused on such a machine). Elsewhere,
# and for docker, nothing.
engine_limits() {
  [ "$(basename "$1")" = podman ] || return 0
  local hard_n
  hard_n=$(ulimit -Hn)
  [ "$hard_n" = unlimited ] && return 0
  if ! (ulimit -Hn $((hard_n + 1))) 2>/dev/null; then
    echo "--ulimit nofile=$hard_n:$hard_n --ulimit nproc=4096:4096"
  fi
}
