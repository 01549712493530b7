# Sourced by the set-up scripts: find_python prints a Python 3.12 (MaxText needs >= 3.12), from PATH, then pyenv.
find_python() {
  local c
  for c in python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}
