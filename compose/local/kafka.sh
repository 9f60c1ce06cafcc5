#!/usr/bin/env bash
# Start or stop a single-node KRaft Kafka broker on 127.0.0.1.
# Usage: kafka.sh start|stop|status
set -euo pipefail
source "$(dirname "$0")/env.sh"

PIDFILE=$KAFKA_DIR/kafka.pid
CONFIG=$KAFKA_DIR/server.properties
LOGFILE=$KAFKA_DIR/logs/server.log
PATTERN="kafka.Kafka $CONFIG"

write_config() {
  mkdir -p "$KAFKA_DIR/data" "$KAFKA_DIR/logs"
  cat >"$CONFIG" <<CFG
# Written by compose/local/kafka.sh; edits are overwritten on the next start.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$KAFKA_DIR/data
$(kafka_single_node_config)
offsets.topic.num.partitions=10
log.retention.hours=24
log.segment.bytes=104857600
CFG
}

start() {
  if pid_alive "$PIDFILE" "$PATTERN"; then
    log "Kafka already running (pid $(cat "$PIDFILE")) on $KAFKA_HOST:$KAFKA_PORT"
    return 0
  fi
  for port in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
    if port_in_use "$port"; then
      die "cannot start Kafka: port $port on 127.0.0.1 is already in use by another process. Stop it, or choose free ports with KAFKA_PORT=<port> (the controller uses KAFKA_PORT+1). Log file: $LOGFILE"
    fi
  done
  "$ROOT/compose/local/fetch-kafka.sh"
  write_config
  if [ ! -f "$KAFKA_DIR/data/meta.properties" ]; then
    local cluster_id
    cluster_id=$(kafka_random_id)
    kafka_format "$CONFIG" "$cluster_id" "$KAFKA_DIR/logs"
  fi
  log "starting Kafka $KAFKA_VERSION on $KAFKA_HOST:$KAFKA_PORT (log: $LOGFILE)"
  kafka_launch "$CONFIG" "$KAFKA_DIR/logs" "$PIDFILE" "$KAFKA_HEAP"
  if ! python3 "$ROOT/compose/local/ready.py" kafka "$KAFKA_HOST" "$KAFKA_PORT" --timeout "$READY_TIMEOUT" --pid "$(cat "$PIDFILE")"; then
    cat "$KAFKA_DIR/logs/stdout.log" >>"$LOGFILE" 2>/dev/null || true
    stop_pid "$PIDFILE" "$PATTERN" Kafka
    fail_start Kafka "$KAFKA_PORT" "$LOGFILE" KAFKA_PORT
  fi
  log "Kafka ready on $KAFKA_HOST:$KAFKA_PORT"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pid "$PIDFILE" "$PATTERN" Kafka ;;
  status) pid_alive "$PIDFILE" "$PATTERN" && echo "kafka running pid $(cat "$PIDFILE")" || { echo "kafka stopped"; exit 1; } ;;
  *) die "usage: kafka.sh start|stop|status" ;;
esac
