#!/usr/bin/env bash
# Start or stop a Redis server on 127.0.0.1 that keeps its data in an append-only
# file under .run/redis-PORT (fsync once a second: a crash loses at most the last
# second of writes), loaded again at start. REDIS_APPENDONLY=no turns it off for
# throwaway runs (a restart then starts empty; `conveyor results rebuild` restores
# results from the reply topics); REDIS_SAVE="3600 1" adds snapshots.
# Usage: redis.sh start|stop|status
set -euo pipefail
source "$(dirname "$0")/env.sh"

PIDFILE=$REDIS_DIR/redis.pid
LOGFILE=$REDIS_DIR/redis.log
PATTERN="redis-server $REDIS_HOST:$REDIS_PORT"

start() {
  if pid_alive "$PIDFILE" "$PATTERN"; then
    log "Redis already running (pid $(cat "$PIDFILE")) on $REDIS_HOST:$REDIS_PORT"
    return 0
  fi
  if port_in_use "$REDIS_PORT"; then
    die "cannot start Redis: port $REDIS_PORT on 127.0.0.1 is already in use by another process. Stop it, or choose a free port with REDIS_PORT=<port>. Log file: $LOGFILE"
  fi
  local appendonly=${REDIS_APPENDONLY:-yes}
  case "$appendonly" in
    yes | no) ;;
    *) die "REDIS_APPENDONLY must be yes (keep data in an append-only file) or no, not '$appendonly'" ;;
  esac
  apt_install redis-server redis-server
  mkdir -p "$REDIS_DIR"
  log "starting Redis on $REDIS_HOST:$REDIS_PORT (append-only file: $appendonly; log: $LOGFILE)"
  nohup redis-server --bind "$REDIS_HOST" --port "$REDIS_PORT" --dir "$REDIS_DIR" \
    --save "${REDIS_SAVE:-}" --appendonly "$appendonly" --appendfsync everysec \
    --logfile "$LOGFILE" --daemonize no \
    >/dev/null 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  if ! python3 "$ROOT/compose/local/ready.py" redis "$REDIS_HOST" "$REDIS_PORT" --timeout "$READY_TIMEOUT" --pid "$(cat "$PIDFILE")"; then
    stop_pid "$PIDFILE" "$PATTERN" Redis
    fail_start Redis "$REDIS_PORT" "$LOGFILE" REDIS_PORT
  fi
  log "Redis ready on $REDIS_HOST:$REDIS_PORT"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pid "$PIDFILE" "$PATTERN" Redis ;;
  status) pid_alive "$PIDFILE" "$PATTERN" && echo "redis running pid $(cat "$PIDFILE")" || { echo "redis stopped"; exit 1; } ;;
  *) die "usage: redis.sh start|stop|status" ;;
esac
