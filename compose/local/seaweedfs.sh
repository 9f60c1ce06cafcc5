#!/usr/bin/env bash
# Start or stop SeaweedFS (master, volume, filer and S3 gateway in one process) on
# 127.0.0.1: the S3-compatible object store that payloads by reference are tested
# against. One identity (S3_ACCESS_KEY / S3_SECRET_KEY) may do everything; requests
# without its signature are refused.
# Usage: seaweedfs.sh start|stop|status
set -euo pipefail
source "$(dirname "$0")/env.sh"

PIDFILE=$SEAWEEDFS_DIR/weed.pid
LOGFILE=$SEAWEEDFS_DIR/weed.log
CONFIG=$SEAWEEDFS_DIR/s3.json
PATTERN="-s3.port=$S3_PORT"

start() {
  if pid_alive "$PIDFILE" "$PATTERN"; then
    log "SeaweedFS already running (pid $(cat "$PIDFILE")) with S3 on $S3_HOST:$S3_PORT"
    return 0
  fi
  local port
  for port in "$S3_PORT" "$SEAWEEDFS_FILER_PORT" "$SEAWEEDFS_MASTER_PORT" "$SEAWEEDFS_VOLUME_PORT" \
    $((S3_PORT + 10000)) $((SEAWEEDFS_FILER_PORT + 10000)) $((SEAWEEDFS_MASTER_PORT + 10000)) $((SEAWEEDFS_VOLUME_PORT + 10000)); do
    if port_in_use "$port"; then
      die "cannot start SeaweedFS: port $port on 127.0.0.1 is already in use by another process. Stop it, or choose other ports with S3_PORT=<port> (the filer, master and volume servers use S3_PORT+555, +1000 and -253, and each of those +10000 for gRPC). Log file: $LOGFILE"
    fi
  done
  "$ROOT/compose/local/fetch-seaweedfs.sh"
  mkdir -p "$SEAWEEDFS_DIR/data"
  cat >"$CONFIG" <<CFG
{"identities": [{"name": "conveyor",
  "credentials": [{"accessKey": "$S3_ACCESS_KEY", "secretKey": "$S3_SECRET_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
CFG
  log "starting SeaweedFS with S3 on $S3_HOST:$S3_PORT (log: $LOGFILE)"
  # A single node has no peers: -volume.preStopSeconds=0 stops it at once instead of
  # announcing its departure for 10 s, and -master.electionTimeout=1s makes its master
  # the Raft leader again 1 s after a restart instead of 10 (reads fail until then).
  nohup "$WEED_BIN" server -dir="$SEAWEEDFS_DIR/data" -ip="$S3_HOST" -ip.bind="$S3_HOST" \
    -master.port="$SEAWEEDFS_MASTER_PORT" -master.volumeSizeLimitMB=256 -master.electionTimeout=1s \
    -volume.port="$SEAWEEDFS_VOLUME_PORT" -volume.max=32 -volume.preStopSeconds=0 \
    -filer -filer.port="$SEAWEEDFS_FILER_PORT" \
    -s3 -s3.port="$S3_PORT" -s3.config="$CONFIG" -s3.port.iceberg=0 -s3.port.lance=0 \
    >"$LOGFILE" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  if ! python3 "$ROOT/compose/local/ready.py" s3 "$S3_HOST" "$S3_PORT" --timeout "$READY_TIMEOUT" --pid "$(cat "$PIDFILE")"; then
    stop_pid "$PIDFILE" "$PATTERN" SeaweedFS
    fail_start SeaweedFS "$S3_PORT" "$LOGFILE" S3_PORT
  fi
  log "SeaweedFS ready: S3 on http://$S3_HOST:$S3_PORT"
}

case "${1:-}" in
  start) start ;;
  # Its volume server stops first; the filer then retries writing its metadata log to
  # it for 15 s before dropping it (the objects and their metadata are already on disk),
  # so 3 s is enough grace.
  stop) stop_pid "$PIDFILE" "$PATTERN" SeaweedFS 3 ;;
  status) pid_alive "$PIDFILE" "$PATTERN" && echo "seaweedfs running pid $(cat "$PIDFILE")" || { echo "seaweedfs stopped"; exit 1; } ;;
  *) die "usage: seaweedfs.sh start|stop|status" ;;
esac
