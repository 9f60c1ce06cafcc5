#!/usr/bin/env bash
# Start or stop a Redis server on 127.0.0.1 with no persistence (test and demo use);
# REDIS_SAVE="3600 1" turns on snapshots, saved at shutdown and loaded at start.
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
  apt_install redis-server redis-server
  mkdir -p "$REDIS_DIR"
  log "starting Redis on $REDIS_HOST:$REDIS_PORT (log: $LOGFILE)"
  nohup redis-server --bind "$REDIS_HOST" --port "$REDIS_PORT" --dir "$REDIS_DIR" \
    --save "${REDIS_SAVE:-}" --appendonly no --logfile "$LOGFILE" --daemonize no \
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
