# Shared by scripts/services.sh and scripts/cluster.sh (sourced, not run).

# Run a command (in a subshell: it execs) without our file descriptors above 2, so that a
# daemon it starts never holds a caller's pipe open (a caller waiting for EOF would hang).
without_extra_fds() {
  local fd
  for fd in /proc/self/fd/*; do
    fd="${fd##*/}"
    if [ "$fd" -gt 2 ] 2>/dev/null; then eval "exec ${fd}>&-" 2>/dev/null || true; fi
  done
  exec "$@"
}

# True if something accepts TCP connections on 127.0.0.1:$1 (bounded to 2 s).
port_open() {
  timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}
